"""The `mmserve` command: `serve` (OpenAI-compatible server), `encode` (a vision-encoder server
for disaggregated serving) and `bench serve` (load generator)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmserve.config.engine import EngineConfig
from mmserve.config.flags import flag_values
from mmserve.config.server import ServerConfig
from mmserve.disaggregation.encode_args import add_encode_args
from mmserve.serve_flags import add_serve_args, serve_configs

logger = logging.getLogger("mmserve")


def build_parser(*, with_bench: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_serve_args(serve_parser)
    # Errors found after parsing are reported with the usage of the subcommand at fault.
    serve_parser.set_defaults(subparser=serve_parser)
    encode_parser = sub.add_parser(
        "encode",
        help="Start a vision-encoder server (the vision tower alone) for `serve --encoder-urls`.",
        description="Encode images for language-model servers: items arrive over ZMQ, "
        "embeddings go back; /health, /metrics, /v1/encode/info and /v1/encode/plan over HTTP.",
    )
    add_encode_args(encode_parser)
    encode_parser.set_defaults(subparser=encode_parser)
    bench = sub.add_parser("bench", help="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="Load-test a running server.")
    if with_bench:
        # Imported only for `mmserve bench ...`, so `mmserve serve` never loads it.
        from mmserve.bench.cli import add_bench_serve_args

        add_bench_serve_args(bench_serve)
    return parser


def main(
    argv: Sequence[str] | None = None, *, build_engine: Callable[[EngineConfig], Any] | None = None
) -> int:
    """Run the command line; `build_engine` replaces the engine factory for `serve` (tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_bench=bool(argv) and argv[0] == "bench")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from mmserve.bench.cli import run_bench_serve

        return int(run_bench_serve(args) or 0)
    if args.command == "encode":
        return encode(args)
    try:
        engine_config, server_config = serve_configs(args, os.environ)
    except ValueError as exc:
        args.subparser.error(str(exc))
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from mmserve.engine.model_source import with_local_sources
    from mmserve.generation_config import load_sampling_defaults

    try:  # a hub id is looked up (and downloaded) before anything starts
        engine_config = with_local_sources(engine_config)
        checkpoint = engine_config.checkpoint
        load_sampling_defaults(checkpoint.generation_config, checkpoint.model, log=False)
    except ValueError as exc:  # ModelNotFoundError included
        args.subparser.error(str(exc))
    _log_vllm_flags(engine_config)
    if engine_config.parallel.headless:  # this node runs tensor-parallel ranks, no server
        from mmserve.engine.core.headless import run_headless

        return run_headless(engine_config, server_config.log_level.upper())
    return serve(engine_config, server_config, build_engine)


def encode(args: argparse.Namespace) -> int:
    """`mmserve encode`: validate the flags, then serve until SIGINT/SIGTERM."""
    from mmserve.disaggregation.encode_args import EncodeServerConfig

    try:
        config = EncodeServerConfig.from_cli(args, os.environ)
    except ValueError as exc:
        args.subparser.error(str(exc))
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # see `serve`: uvicorn re-raises the signal
        signal.signal(sig, lambda *_: None)
    from mmserve.disaggregation.encoder_server import run_encoder_server

    try:
        return run_encoder_server(config)
    except Exception:
        logger.exception("mmserve encode failed")
        return 1


def _log_vllm_flags(config: EngineConfig) -> None:
    """Flags a vLLM command line brings that change nothing here: said once, not ignored."""
    if config.checkpoint.trust_remote_code:
        logger.info(
            "--trust-remote-code: accepted; mmserve implements Qwen2-VL and Qwen2.5-VL itself "
            "and never runs code that comes with a checkpoint"
        )


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    build_engine: Callable[[EngineConfig], Any] | None = None,
) -> int:
    """Build the engine, then serve until SIGINT/SIGTERM; exits 0 after a graceful shutdown."""
    # uvicorn re-raises the signal it caught after its shutdown, with the handler that was
    # installed before it started; a no-op handler turns that into a clean exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        return asyncio.run(_serve(engine_config, server_config, build_engine))
    except Exception:
        logger.exception("mmserve failed")
        return 1


async def _serve(
    engine_config: EngineConfig,
    settings: ServerConfig,
    build_engine: Callable[[EngineConfig], Any] | None,
) -> int:
    """Serve until a signal (exit code 0) or the engine's death (1: a supervisor restarts it)."""
    import uvicorn

    from mmserve.api.app import create_app
    from mmserve.api.http_protocol import header_deadline_protocol

    if build_engine is None:
        from mmserve.engine.frontend.async_engine import build_async_engine as build_engine

    engine = build_engine(engine_config)
    if inspect.isawaitable(engine):
        engine = await engine
    names = engine_config.checkpoint.served_model_names
    _log_configuration(engine_config, settings, engine, ", ".join(names))
    try:
        app = create_app(
            engine,
            api_keys=settings.api_key,
            served_model_name=names,
            max_request_body_bytes=settings.max_request_body_bytes,
            http_body_timeout_s=settings.http_body_timeout,
            shutdown_timeout_s=settings.engine_shutdown_timeout_s,
            trust_request_chat_template=settings.trust_request_chat_template,
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
            tool_call_parser=settings.tool_call_parser,
            reasoning_parser=settings.reasoning_parser,
        )
    except ValueError:  # a flag the model cannot serve (--reasoning-parser)
        await engine.shutdown(timeout_s=settings.engine_shutdown_timeout_s)
        raise
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.uvicorn_log_level,
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout_s,
        lifespan="on",
        http=header_deadline_protocol(settings.http_header_timeout),  # type: ignore[arg-type]
        timeout_keep_alive=settings.http_keep_alive_timeout,  # type: ignore[arg-type]
        ws="none",  # no websocket routes; an upgrade request is answered as plain HTTP
    )
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    engine_died = asyncio.Event()

    def stop_serving(reason: str) -> None:  # from the engine thread
        logger.error("the engine died (%s): the server stops", reason)
        loop.call_soon_threadsafe(engine_died.set)
        server.should_exit = True  # in-flight requests have their 503s; /health says 503 too

    engine.on_dead = stop_serving
    if not engine.is_healthy():  # died before it could be told whom to call
        stop_serving("before the server started")
    logger.info("serving %r on http://%s:%d", names[0], settings.host, settings.port)
    await server.serve()
    return 1 if engine_died.is_set() else 0


def _log_configuration(
    engine_config: EngineConfig, settings: ServerConfig, engine: Any, name: str
) -> None:
    """One block: what the engine resolved (sizes with their byte cost), then the flags."""
    lines = [f"  served model name: {name}"]
    describe = getattr(engine, "describe", None)
    if callable(describe):
        lines.append("  engine (resolved):")
        lines.extend(f"    {key}: {_with_units(key, value)}" for key, value in describe().items())
    lines.append("  flags:")
    flags = {**engine_config.flag_values(), **flag_values(settings)}
    for key, value in flags.items():
        if key != "api_key":
            lines.append(f"    {key}: {json.dumps(value) if isinstance(value, dict) else value}")
    lines.append(f"    api_key: {'set' if settings.api_key else 'not set'}")
    logger.info("configuration:\n%s", "\n".join(lines))


def _with_units(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return f"{value} ({value / (1 << 20):.1f} MiB)"
    return str(value)
