"""`mmserve bench serve`: arguments, the run, and its reports."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import math
import os
import sys

import httpx

from mmserve.bench.client import LoadConfig, RequestOutput, run_load
from mmserve.bench.metrics import compute_metrics
from mmserve.bench.report import format_table, write_json, write_plot
from mmserve.bench.server_metrics import diff_snapshots, scrape, scrape_settled, unavailable
from mmserve.bench.workload import (
    BenchRequest,
    WorkloadConfig,
    WorkloadError,
    build_workload,
    parse_image_sizes,
)

logger = logging.getLogger(__name__)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)",
    )
    server.add_argument("--endpoint", default="/v1/chat/completions")
    server.add_argument(
        "--metrics-endpoint",
        default="/metrics",
        help="Prometheus endpoint scraped before and after the run",
    )
    server.add_argument(
        "--no-server-metrics", action="store_true", help="do not scrape the metrics endpoint"
    )
    server.add_argument(
        "--model",
        default=None,
        help="model name to send; default: the first id from GET /v1/models",
    )
    server.add_argument(
        "--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)"
    )
    server.add_argument("--request-timeout", type=float, default=600.0, help="seconds")

    wl = parser.add_argument_group("workload")
    wl.add_argument(
        "--dataset",
        default=None,
        help='JSONL of real requests: {"messages": [...], "max_tokens": N} a line',
    )
    wl.add_argument("--num-prompts", type=int, default=100)
    wl.add_argument(
        "--image-sizes",
        default="448x448",
        help="WIDTHxHEIGHT list; each new image picks one at random",
    )
    wl.add_argument("--images-per-request", type=int, default=1)
    wl.add_argument(
        "--repeat-ratio",
        type=float,
        default=0.0,
        help="share of requests that resend an earlier request's exact image bytes",
    )
    wl.add_argument(
        "--unique-images",
        type=int,
        default=None,
        help="send only this many distinct images (sets), each equally often, shuffled: e.g. "
        "--num-prompts 48 --unique-images 8 sends each picture 6 times (not with --repeat-ratio)",
    )
    wl.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="approximate length of a system prompt common to all requests",
    )
    wl.add_argument(
        "--input-len",
        type=int,
        default=32,
        help="approximate random text tokens per request (besides images)",
    )
    wl.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="max_tokens per request (exact with --ignore-eos)",
    )
    wl.add_argument(
        "--image-format",
        choices=("jpeg", "png"),
        default="jpeg",
        help="jpeg (quality 90) of a smooth synthetic pattern, or lossless png",
    )
    wl.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so every request generates exactly max_tokens",
    )
    wl.add_argument("--temperature", type=float, default=0.0)
    wl.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second; inf sends all requests at once",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: unlimited)",
    )
    load.add_argument("--seed", type=int, default=0, help="makes the workload repeatable")
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    out = parser.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="write the full result to this file")
    out.add_argument("--plot", default=None, help="write latency CDFs and throughput to a PNG")


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        requests = build_workload(_workload_config(args))
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra_body, dict):
            raise WorkloadError("--extra-body must be a JSON object")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise WorkloadError("--max-concurrency must be >= 1")
        if not args.request_rate > 0:
            raise WorkloadError("--request-rate must be > 0 (inf sends everything at once)")
    except (WorkloadError, json.JSONDecodeError) as e:
        sys.stderr.write(f"mmserve bench serve: {e}\n")
        return 2
    return asyncio.run(_bench(args, requests, extra_body))


def _workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_prompts=args.num_prompts,
        seed=args.seed,
        image_sizes=parse_image_sizes(args.image_sizes),
        images_per_request=args.images_per_request,
        repeat_ratio=args.repeat_ratio,
        unique_images=args.unique_images,
        shared_prefix_tokens=args.shared_prefix_tokens,
        input_len=args.input_len,
        output_len=args.output_len,
        image_format=args.image_format,
        dataset_path=args.dataset,
    )


async def _bench(args: argparse.Namespace, requests: list[BenchRequest], extra: dict) -> int:
    root = args.base_url.rstrip("/").removesuffix("/v1")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    metrics_url = root + args.metrics_endpoint
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        model = args.model or await _first_model(client, root, headers)
        if model is None:
            sys.stderr.write(
                f"mmserve bench serve: GET {root}/v1/models gave no model; "
                "check --base-url or pass --model\n"
            )
            return 1
        before = None if args.no_server_metrics else await scrape(client, metrics_url, headers)
        cfg = LoadConfig(
            chat_url=root + args.endpoint,
            model=model,
            headers=headers,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            timeout_s=args.request_timeout,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            extra_body=extra,
            show_progress=not args.disable_tqdm,
        )
        outputs, duration_s = await run_load(requests, cfg)
        if before is None:
            server = unavailable("not scraped (--no-server-metrics)")
        elif before.snapshot is None:
            server = unavailable(before.reason or "no metrics")
        else:
            after = await scrape_settled(client, metrics_url, headers)
            server = (
                diff_snapshots(before.snapshot, after.snapshot)
                if after.snapshot
                else unavailable(after.reason or "no metrics after the run")
            )
    metrics = compute_metrics(outputs, duration_s)
    sys.stdout.write(format_table(metrics, server) + "\n")
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": root,
        "endpoint": args.endpoint,
        "model": model,
        "args": _args_json(args),
        "workload": _workload_summary(requests),
        **metrics.to_json(),
        "server_metrics": server,
        "requests": [_request_row(o, r) for o, r in zip(outputs, requests, strict=True)],
    }
    if args.result_json:
        write_json(result, args.result_json)
    if args.plot:
        write_plot(outputs, duration_s, args.plot)
    return 0 if metrics.completed else 1


async def _first_model(client: httpx.AsyncClient, root: str, headers: dict) -> str | None:
    try:
        resp = await client.get(root + "/v1/models", headers=headers)
    except httpx.HTTPError as e:
        logger.error("GET %s/v1/models failed: %s", root, type(e).__name__)
        return None
    try:
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError):
        logger.error("GET %s/v1/models returned HTTP %d without a model id", root, resp.status_code)
        return None


def _args_json(args: argparse.Namespace) -> dict:
    # str() for inf: strict JSON has no Infinity, and --request-rate defaults to it.
    return {
        k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in vars(args).items()
        if v is None or isinstance(v, str | int | float | bool)
    }


def _workload_summary(requests: list[BenchRequest]) -> dict:
    num_images = sum(r.num_images for r in requests)
    num_repeated = sum(r.num_repeated_images for r in requests)
    return {
        "num_requests": len(requests),
        "num_images": num_images,
        "num_repeated_images": num_repeated,  # image items already sent earlier in this run
        "num_unique_images": num_images - num_repeated,
        "num_requests_with_repeats": sum(r.num_repeated_images > 0 for r in requests),
    }


def _request_row(o: RequestOutput, r: BenchRequest) -> dict:
    return {
        "idx": o.idx,
        "success": o.is_success,
        "error_kind": o.error_kind,
        "error_message": o.error_message,
        "sent_at_s": o.sent_at_s,
        "ttft_s": o.ttft_s,
        "latency_s": o.latency_s,
        "tpot_s": o.tpot_s,
        "output_tokens": o.output_tokens,
        "content_chunks": o.num_content_chunks,
        "prompt_tokens": o.prompt_tokens,
        "num_images": r.num_images,
        "num_repeated_images": r.num_repeated_images,
    }
