"""Streams chat completions to the server under a Poisson or burst arrival pattern."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from mmserve.bench.workload import BenchRequest


@dataclass(slots=True)
class RequestOutput:
    """What the client saw of one request. Times are seconds; `*_at_s` are since the run start."""

    idx: int
    is_success: bool = False
    error_kind: str | None = None
    error_message: str | None = None
    sent_at_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_at_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    num_content_chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    has_usage: bool = False

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadConfig:
    chat_url: str
    model: str
    headers: dict[str, str]
    request_rate: float = float("inf")  # requests per second; inf sends everything at once
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True


def build_payload(req: BenchRequest, cfg: LoadConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": cfg.model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        # Exact token counts come from the final usage chunk; without it we count chunks.
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True  # vLLM/SGLang/mmserve extension: always emit max_tokens
    payload.update(cfg.extra_body)
    return payload


async def send_chat_request(
    client: httpx.AsyncClient, cfg: LoadConfig, req: BenchRequest, idx: int, run_start: float
) -> RequestOutput:
    out = RequestOutput(idx=idx)
    start = time.perf_counter()
    out.sent_at_s = start - run_start
    try:
        async with client.stream(
            "POST", cfg.chat_url, json=build_payload(req, cfg), headers=cfg.headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return _fail(out, f"http_{resp.status_code}", body[:300])
            is_done = await _read_stream(resp, out, start, run_start)
    except httpx.TimeoutException as e:
        return _fail(out, "timeout", repr(e))
    except httpx.ConnectError as e:
        return _fail(out, "connect_error", repr(e))
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        return _fail(out, "connection_closed", repr(e))
    except httpx.HTTPError as e:
        return _fail(out, "http_error", repr(e))
    except _StreamError as e:
        return _fail(out, e.kind, str(e))
    out.latency_s = time.perf_counter() - start
    if not is_done:
        return _fail(out, "incomplete_stream", "stream ended without [DONE] or finish_reason")
    if not out.has_usage:
        out.output_tokens = out.num_content_chunks
    if out.output_tokens == 0:
        return _fail(out, "empty_output", "the server streamed no output tokens")
    out.is_success = True
    return out


class _StreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _read_stream(
    resp: httpx.Response, out: RequestOutput, start: float, run_start: float
) -> bool:
    """Consumes the SSE stream into `out`; True when the server finished it properly."""
    is_done = False
    last = start
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, ': keep-alive' comments, 'event:' lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamError("bad_response", f"non-JSON SSE data: {data[:200]}") from None
        if not isinstance(chunk, dict):
            raise _StreamError("bad_response", f"SSE data is not an object: {data[:200]}")
        if "error" in chunk:
            raise _StreamError("stream_error", json.dumps(chunk["error"])[:300])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # NOTE: only non-empty text counts: many servers open with a role-only chunk
            # (content "") before any token exists.
            if delta.get("content") or delta.get("reasoning_content"):
                now = time.perf_counter()
                if out.ttft_s is None:
                    out.ttft_s = now - start
                else:
                    out.itl_s.append(now - last)
                last = now
                out.num_content_chunks += 1
                out.chunk_at_s.append(now - run_start)
            is_done = is_done or choice.get("finish_reason") is not None
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            out.has_usage = True
            out.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                out.prompt_tokens = int(usage["prompt_tokens"])
    return is_done


def _fail(out: RequestOutput, kind: str, message: str) -> RequestOutput:
    out.is_success = False
    out.error_kind = kind
    out.error_message = message
    return out


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int) -> np.ndarray:
    """Send times of a Poisson process (exponential gaps), the first at 0; all 0 when rate=inf."""
    if request_rate == float("inf"):
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the workload uses `seed`
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)  # [num_requests]
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_load(
    requests: list[BenchRequest], cfg: LoadConfig
) -> tuple[list[RequestOutput], float]:
    """Sends every request and returns the outputs in workload order and the run's duration."""
    offsets = arrival_offsets_s(len(requests), cfg.request_rate, cfg.seed)
    semaphore = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency or len(requests), max_keepalive_connections=None
    )
    progress = tqdm(total=len(requests), disable=not cfg.show_progress, unit="req")
    # trust_env=False: an HTTP proxy from the environment would sit in every measurement.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False
    ) as client:
        run_start = time.perf_counter()

        async def one(idx: int, req: BenchRequest) -> RequestOutput:
            await asyncio.sleep(max(0.0, run_start + offsets[idx] - time.perf_counter()))
            async with semaphore:
                out = await send_chat_request(client, cfg, req, idx, run_start)
            progress.update(1)
            return out

        outputs = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration_s = time.perf_counter() - run_start
    progress.close()
    return list(outputs), duration_s
