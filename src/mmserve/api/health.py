"""/health of a server with data-parallel replicas: 200 while any replica is live."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi.responses import JSONResponse

from mmserve.engine.frontend.replicas import ReplicaState


def replica_health(replicas: Sequence[ReplicaState]) -> JSONResponse:
    """`status` "ok" (every replica live), "degraded" (some being restarted: still 200, the
    live ones serve every request) or "unavailable" (none live: 503), and each replica's state.
    """
    num_live = sum(r.is_live for r in replicas)
    status = "ok" if num_live == len(replicas) else "degraded" if num_live else "unavailable"
    body = {
        "status": status,
        "replicas_live": num_live,
        "replicas_total": len(replicas),
        "replicas": [
            {
                "replica": r.index,
                "device": r.device,
                "state": "running" if r.is_live else "restarting",
                "requests": r.num_requests,
                **({} if r.is_live else {"reason": r.dead_reason}),
            }
            for r in replicas
        ],
    }
    return JSONResponse(body, status_code=200 if num_live else 503)
