"""HTTP server configuration: address, limits, timeouts, keys, logging. Never sent to the engine."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config.flags import check_choice, check_positive, check_seconds, flag

API_KEY_ENV = "MMSERVE_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
FRONTEND = "Frontend (HTTP server)"
DEFAULT_HOST = "127.0.0.1"
# The output parsers a server can run on chat answers (api/hermes.py, api/reasoning.py).
TOOL_CALL_PARSERS = ("hermes",)
REASONING_PARSERS = ("qwen3",)


def host_flag(help_text: str) -> str:
    return flag(DEFAULT_HOST, group=FRONTEND, help=help_text)


def log_level_flag() -> str:
    return flag(
        "info", choices=LOG_LEVELS, group=FRONTEND, help="mmserve's log level. Default {default}."
    )


def uvicorn_log_level_flag() -> str:
    return flag(
        "warning",
        choices=LOG_LEVELS,
        group=FRONTEND,
        help="uvicorn's log level (access logs appear at info). Default {default}.",
    )


@dataclass(frozen=True)
class ServerConfig:
    """What the API process's HTTP server runs with (the engine never sees any of it)."""

    host: str = host_flag("Address to bind. Default {default}.")
    port: int = flag(8000, type=int, group=FRONTEND, help="Port to listen on. Default {default}.")
    api_key: tuple[str, ...] | None = flag(
        None,
        nargs="+",
        group=FRONTEND,
        metavar="KEY",
        repr=False,
        help="Require 'Authorization: Bearer KEY' on /v1/* (several keys: one per tenant, each "
        f"with its own media-UUID namespace); also read from ${API_KEY_ENV} (comma-separated).",
    )
    max_request_body_bytes: int = flag(
        64 << 20,
        type=int,
        group=FRONTEND,
        unit="bytes",
        help="Largest HTTP request body (data: URLs included); bigger ones get 413. "
        "Default {default}.",
    )
    # HTTP server timeouts, in seconds (see api/http_protocol.py for the timeline).
    http_header_timeout: float = flag(
        10.0,
        type=float,
        group=FRONTEND,
        metavar="SECONDS",
        help="A connection must send a request's complete headers within this long of opening "
        "or of the previous response (a deadline: slow bytes do not extend it), else 408 and "
        "close. Default {default}.",
    )
    http_body_timeout: float = flag(
        60.0,
        type=float,
        group=FRONTEND,
        metavar="SECONDS",
        help="A request's whole body must arrive within this long of its headers, else 408 "
        "and close. Default {default}.",
    )
    http_keep_alive_timeout: float = flag(
        5.0,
        type=float,
        group=FRONTEND,
        metavar="SECONDS",
        help="An idle keep-alive connection is closed after this long without a new request. "
        "Default {default}.",
    )
    trust_request_chat_template: bool = flag(
        False,
        action="store_true",
        group=FRONTEND,
        help="Render a request's own chat_template (in the sandboxed Jinja environment, at "
        "most 64 KiB); without this flag such a request gets 400, as in vLLM.",
    )
    log_level: str = log_level_flag()
    uvicorn_log_level: str = uvicorn_log_level_flag()
    # Chat answers: tool calls and reasoning (docs/tools.md).
    enable_auto_tool_choice: bool = flag(
        False,
        action="store_true",
        group=FRONTEND,
        help='Let requests send tool_choice "auto" (the default when tools are given): the '
        "answer is parsed for tool calls by --tool-call-parser.",
    )
    tool_call_parser: str | None = flag(
        None,
        choices=TOOL_CALL_PARSERS,
        group=FRONTEND,
        help="How tool calls are written in the model's text (hermes: <tool_call>{json}"
        "</tool_call>, as Qwen2.5 and Qwen3 do). Needed by --enable-auto-tool-choice.",
    )
    reasoning_parser: str | None = flag(
        None,
        choices=REASONING_PARSERS,
        group=FRONTEND,
        help="Split the model's reasoning (qwen3: <think>...</think>) from chat answers into "
        "message.reasoning_content. Default: answers are returned as generated.",
    )
    # Shutdown (no flags): how long in-flight requests may run after SIGTERM before they are
    # cancelled, then how long the engine is given to stop.
    graceful_shutdown_timeout_s: int = 20  # uvicorn takes whole seconds
    engine_shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        check_positive("max_request_body_bytes", self.max_request_body_bytes)
        for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout"):
            check_seconds(name, getattr(self, name))
        for name in ("graceful_shutdown_timeout_s", "engine_shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0 s, got {getattr(self, name)}")
        check_choice("log_level", self.log_level, LOG_LEVELS)
        check_choice("uvicorn_log_level", self.uvicorn_log_level, LOG_LEVELS)
        if self.tool_call_parser is not None:
            check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of "
                f"{', '.join(TOOL_CALL_PARSERS)}) to read the tool calls out of the answers"
            )
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not keys or not all(isinstance(k, str) and k.strip() for k in keys):
                raise ValueError("--api-key must not be empty (omit it to disable authentication)")
            object.__setattr__(self, "api_key", keys)
