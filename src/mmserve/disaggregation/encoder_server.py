"""`mmserve encode`: the vision tower alone behind a ZMQ ROUTER (items in, embeddings out) and
an HTTP server (health, metrics, the pairing info and URL plans), in one process.

    LM servers ──ZMQ DEALER──> ROUTER :Z ──> EncoderWorker (batches, cache) ──> VisionStage
    LM API     ──HTTP──> :P  /v1/encode/info, /v1/encode/plan (fetch + header + grid),
                             /health, /metrics
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmserve.config.media import SERVER_DECODE_WORKERS
from mmserve.config.torch_device import resolve_device, resolve_dtype
from mmserve.disaggregation.embedding_cache import ByteBudgetLRU, CachedEmbedding
from mmserve.disaggregation.encode_args import DEFAULT_PATCH_BUDGET, EncodeServerConfig
from mmserve.disaggregation.encoder_metrics import EncoderMetrics
from mmserve.disaggregation.encoder_worker import EncoderWorker
from mmserve.disaggregation.media_stage import ItemError, MediaStage
from mmserve.disaggregation.protocol import (
    ENCODER_PROTOCOL_VERSION,
    MAX_HEADER_BYTES,
    is_input_error,
    model_fingerprint,
)
from mmserve.disaggregation.vision_stage import VisionStage
from mmserve.models.config import load_model_config
from mmserve.models.loader import load_vision_tower
from mmserve.processing.image_processor import ImageProcessorConfig, max_tokens_per_item
from mmserve.processing.media import MediaLoader

logger = logging.getLogger(__name__)
CPU_STAGE_THREADS = 4  # image processing threads (decoding runs in worker processes)
MAX_PLAN_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class EncoderInfo:
    """GET /v1/encode/info: what an LM server checks before it pairs with this encoder.
    `embedding_width` is the width of the rows it returns: hidden size x (1 + DeepStack
    levels)."""

    protocol_version: int
    zmq_port: int
    model_fingerprint: str
    embedding_width: int
    dtype: str
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int


class PlanRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    min_pixels: int
    max_pixels: int


class EncoderServer:
    """Everything `mmserve encode` runs; `serve()` until `stop()` (or a signal)."""

    def __init__(self, config: EncodeServerConfig, *, decode_workers: int) -> None:
        self.config = config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, load_model_config(config.model).dtype)
        tower, model_config = load_vision_tower(config.model, device, dtype)
        self.vision = VisionStage(
            tower, device, dtype, embedding_width=model_config.mm_embedding_width
        )
        image_config = ImageProcessorConfig.from_pretrained(config.model)
        media = MediaLoader(
            config.media.for_loader(
                processor_max_pixels=image_config.max_pixels, decode_workers=decode_workers
            )
        )
        media.start_decode_workers()  # the first images find them ready
        self.media = MediaStage(media, image_config, CPU_STAGE_THREADS)
        self.cache: ByteBudgetLRU[CachedEmbedding] = ByteBudgetLRU(config.cache_bytes)
        self.metrics = EncoderMetrics()
        merge = model_config.spatial_merge_size
        largest = max_tokens_per_item(image_config) * merge * merge
        self.patch_budget = config.encoder_patch_budget or max(DEFAULT_PATCH_BUDGET, largest)
        vision_cfg = model_config.vision
        self.info = EncoderInfo(
            protocol_version=ENCODER_PROTOCOL_VERSION,
            zmq_port=config.zmq_port,
            model_fingerprint=model_fingerprint(config.model),
            embedding_width=self.vision.embedding_width,
            dtype=self.vision.dtype_name,
            spatial_merge_size=merge,
            patch_size=vision_cfg.patch_size,
            temporal_patch_size=vision_cfg.temporal_patch_size,
        )
        self._max_message_bytes = (
            max(media.config.max_media_bytes, media.config.image_pixel_cap * 3)
            + 2 * MAX_HEADER_BYTES
        )
        self._uvicorn: Any = None
        self._worker_task: asyncio.Task | None = None

    def is_healthy(self) -> bool:
        return self._worker_task is not None and not self._worker_task.done()

    def stop(self) -> None:
        """Ask a running `serve()` to return (thread-safe: uvicorn polls the flag)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def serve(self) -> None:
        import uvicorn

        ctx = zmq.asyncio.Context()
        socket = self._bind(ctx)
        worker = EncoderWorker(
            socket=socket,
            media=self.media,
            vision=self.vision,
            cache=self.cache,
            metrics=self.metrics,
            fingerprint=self.info.model_fingerprint,
            patch_budget=self.patch_budget,
            secret=self.config.secret,
        )
        self.metrics.add_gauges(
            queued_patches=lambda: worker.queued_patches,
            queued_items=lambda: worker.num_queued,
            cache_bytes=lambda: self.cache.num_bytes,
            plan_store_bytes=lambda: self.media.plan_store_bytes,
        )
        self._worker_task = asyncio.create_task(worker.run())
        uv_config = uvicorn.Config(
            create_encoder_app(self),
            host=self.config.host,
            port=self.config.port,
            log_level=self.config.uvicorn_log_level,
            lifespan="off",
            ws="none",
        )
        self._uvicorn = uvicorn.Server(uv_config)
        logger.info(
            "encoding with %s on http://%s:%d (ZMQ port %d, patch budget %d, cache %.1f GiB)",
            self.config.model,
            self.config.host,
            self.config.port,
            self.config.zmq_port,
            self.patch_budget,
            self.config.cache_bytes / (1 << 30),
        )
        try:
            await self._uvicorn.serve()
        finally:
            self._worker_task.cancel()
            await asyncio.gather(self._worker_task, return_exceptions=True)
            socket.close(linger=0)
            ctx.term()
            self.media.close()
        if not self._uvicorn.started:
            raise RuntimeError(f"the HTTP server could not start on port {self.config.port}")

    def _bind(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        socket = ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)  # a bigger one is cut off
        socket.setsockopt(zmq.LINGER, 0)
        host = self.config.host
        if ":" in host:
            socket.setsockopt(zmq.IPV6, 1)
            host = f"[{host.strip('[]')}]"
        try:
            socket.bind(f"tcp://{host}:{self.config.zmq_port}")
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise RuntimeError(
                f"cannot bind the ZMQ socket on {self.config.host}:{self.config.zmq_port} "
                f"({exc}); pick another --zmq-port"
            ) from None
        return socket


def create_encoder_app(server: EncoderServer) -> FastAPI:
    app = FastAPI(title="mmserve encode", docs_url=None, redoc_url=None, openapi_url=None)
    secret = server.config.secret
    metrics = server.metrics

    def refused(request: Request) -> JSONResponse | None:
        if secret is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, b"Bearer " + secret):
            return None
        return _error(401, "unauthorized", "missing or wrong 'Authorization: Bearer <secret>'")

    @app.get("/health")
    async def health() -> Response:
        if server.is_healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/encode/info")
    async def info(request: Request) -> Response:
        return refused(request) or JSONResponse(asdict(server.info))

    @app.post("/v1/encode/plan")
    async def plan(request: Request) -> Response:
        denied = refused(request)
        if denied is not None:
            return denied
        body = await request.body()
        try:
            if len(body) > MAX_PLAN_BODY_BYTES:
                raise ValueError(f"a plan body is at most {MAX_PLAN_BODY_BYTES} bytes")
            req = msgspec.json.decode(body, type=PlanRequest)
            url_plan = await server.media.plan(req.url, req.min_pixels, req.max_pixels)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            metrics.plan_requests.labels("bad_request").inc()
            expected = 'a JSON object {"url": str, "min_pixels": int, "max_pixels": int}'
            return _error(400, "bad_request", f"the plan body must be {expected}: {exc}")
        except ItemError as exc:
            metrics.plan_requests.labels(exc.code).inc()
            status = 400 if is_input_error(exc.code) else 503
            return _error(status, exc.code, exc.message, exc.param)
        metrics.plan_requests.labels("ok").inc()
        answer = asdict(url_plan)
        answer["grid_thw"] = list(url_plan.grid_thw)
        return JSONResponse(answer)

    return app


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message, "param": param}}, status_code=status
    )


def run_encoder_server(config: EncodeServerConfig) -> int:
    """The CLI's entry: build, serve until SIGINT/SIGTERM; 0 after a clean stop."""
    server = EncoderServer(config, decode_workers=SERVER_DECODE_WORKERS)
    asyncio.run(server.serve())
    return 0
