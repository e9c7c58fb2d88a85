"""The FastAPI app: OpenAI routes over an EngineClient, plus /health, /metrics and auth."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from mmserve.api.auth import ApiKeyMiddleware, request_namespace
from mmserve.api.body_limit import RequestBodyMiddleware
from mmserve.api.chat_output import AnswerParsing
from mmserve.api.errors import (
    APIError,
    as_api_error,
    error_response,
    install_error_handlers,
    validation_error,
)
from mmserve.api.formats import ChatFormat, CompletionFormat, ResponseFormat
from mmserve.api.generation import (
    ClientGoneError,
    SSEResponse,
    close_outputs,
    collect_final,
    raise_if_failed,
    sampling_params_for,
    stream_events,
    until_disconnect,
)
from mmserve.api.health import replica_health
from mmserve.api.json_body import read_json_body
from mmserve.api.prometheus import build_registry, render
from mmserve.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from mmserve.api.reasoning import think_token_ids, thinking_enabled
from mmserve.api.responses import (
    new_response_id,
    parse_responses_request,
    renamed_params,
    to_chat_request,
)
from mmserve.api.responses_output import ResponsesFormat
from mmserve.api.responses_stream import response_events
from mmserve.api.status import report_status
from mmserve.api.tokenize import (
    detokenize,
    parse_detokenize_request,
    parse_tokenize_request,
    tokenize,
)
from mmserve.api.tools import ToolRequest, tool_request, with_tools
from mmserve.api.unsupported import refuse_unsupported_fields
from mmserve.config.server import ServerConfig
from mmserve.engine.frontend.outputs import OutputKind
from mmserve.engine.frontend.protocol import EngineClient
from mmserve.errors import EngineDeadError, InvalidRequestError
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
BodyT = TypeVar("BodyT", bound=BaseModel)

# Status 499 (nginx's "client closed request"): nobody reads it, but the access log should not
# show a disconnect as a success or as a server error.
_CLIENT_GONE_STATUS = 499
# Fields of the unsupported list that one endpoint implements (vLLM has them on that one).
_CHAT_ONLY_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})
_COMPLETION_ONLY_FIELDS = frozenset({"echo"})
_TRUSTED = frozenset({"chat_template"})  # with --trust-request-chat-template


def create_app(
    engine: EngineClient,
    *,
    api_keys: Sequence[str] | None,
    served_model_name: str | Sequence[str],
    max_request_body_bytes: int,
    http_body_timeout_s: float = ServerConfig.http_body_timeout,  # the flag's default
    status_interval_s: float | None = 5.0,
    shutdown_timeout_s: float = ServerConfig.engine_shutdown_timeout_s,
    trust_request_chat_template: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """An app serving `engine` under `served_model_name` (one name or several: clients may send
    any, answers carry the first); it shuts the engine down on exit. The last three are the
    flags of the same names (docs/tools.md)."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names:
        raise ValueError("served_model_name needs at least one name")
    primary = names[0]
    think_ids = think_token_ids(engine, reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reporter = None
        if status_interval_s:
            reporter = asyncio.create_task(report_status(engine.metrics, status_interval_s))
        try:
            yield
        finally:
            if reporter is not None:
                reporter.cancel()
            await engine.shutdown(timeout_s=shutdown_timeout_s)

    app = FastAPI(title="mmserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    # Added innermost first: a request meets auth, then the body checks, then the routes.
    app.add_middleware(
        RequestBodyMiddleware,
        max_body_bytes=max_request_body_bytes,
        body_timeout_s=http_body_timeout_s,
    )
    app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    registry = build_registry(engine.metrics, model_name=primary)
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models(namespace: str = Depends(request_namespace)) -> dict[str, Any]:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "mmserve",
                "root": primary,
                "max_model_len": engine.max_model_len,
            }
            for name in names
        ]
        return {"object": "list", "data": cards}

    async def _chat_prompt(
        request: Request, body: ChatCompletionRequest, namespace: str
    ) -> tuple[SamplingParams, ProcessedPrompt, ToolRequest | None]:
        """What chat and Responses share: tools checked, sampling params, the rendered and
        processed prompt (the same path, so the same input gives the same answer)."""
        tools = tool_request(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            enable_auto_tool_choice=enable_auto_tool_choice,
        )
        params = with_tools(_check_before_processing(body), tools)
        add_generation_prompt, continue_final_message = body.render_choice()
        prompt = await until_disconnect(
            request,
            engine.process_chat(
                [m.model_dump(exclude_none=True) for m in body.messages],
                mm_processor_kwargs=body.mm_processor_kwargs,
                multi_modal_uuids=body.multi_modal_uuids,
                namespace=namespace,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=body.chat_template,
                media_io_kwargs=body.media_io_kwargs,
                tools=tools.template_tools if tools is not None else None,
            ),
        )
        return params, prompt, tools

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, namespace: str = Depends(request_namespace)):
        async def run() -> Response:
            supported = (
                _CHAT_ONLY_FIELDS | _TRUSTED if trust_request_chat_template else _CHAT_ONLY_FIELDS
            )
            body = await _parse(request, ChatCompletionRequest, supported)
            params, prompt, tools = await _chat_prompt(request, body, namespace)
            parsing = None
            if tools is not None or think_ids is not None:
                parsing = AnswerParsing(
                    tools=tools,
                    auto_tool_parser=tool_call_parser,
                    think_token_ids=think_ids,
                    thinking=thinking_enabled(body.chat_template_kwargs),
                )
            fmt = ChatFormat(
                f"chatcmpl-{uuid.uuid4().hex}",
                primary,
                num_top_logprobs=params.logprobs or 0,
                prompt_token_ids=prompt.prompt_token_ids if body.return_token_ids else None,
                role=body.response_role,
                parsing=parsing,
            )
            return await _generate(request, body, params, prompt, fmt)

        return await _answer(run)

    @v1.post("/completions")
    async def completions(request: Request, namespace: str = Depends(request_namespace)):
        async def run() -> Response:
            body = await _parse(request, CompletionRequest, _COMPLETION_ONLY_FIELDS)
            params = _check_before_processing(body)
            prompt_in = body.single_prompt()
            prompt = await until_disconnect(
                request, engine.process_prompt(prompt_in, namespace=namespace)
            )
            ids = prompt.prompt_token_ids
            fmt = CompletionFormat(
                f"cmpl-{uuid.uuid4().hex}",
                primary,
                num_top_logprobs=params.logprobs or 0,
                prompt_token_ids=ids if body.return_token_ids else None,
                echo_prompt=(prompt.prompt or "", list(ids)) if body.echo else None,
                decode=engine.decode_tokens,
            )
            return await _generate(request, body, params, prompt, fmt)

        return await _answer(run)

    @v1.post("/responses")
    async def responses(request: Request, namespace: str = Depends(request_namespace)):
        async def run() -> Response:
            with renamed_params() as names_of:
                body = parse_responses_request(await read_json_body(request))
                names_of.num_instruction_messages = int(body.instructions is not None)
                chat = to_chat_request(body)
                params, prompt, tools = await _chat_prompt(request, chat, namespace)
                parsing = None
                if tools is not None:
                    parsing = AnswerParsing(tools=tools, auto_tool_parser=tool_call_parser)
                fmt = ResponsesFormat(body, primary, params, new_response_id(), parsing)
                return await _generate(request, chat, params, prompt, fmt, response_events)

        return await _answer(run)

    @app.post("/tokenize")
    async def tokenize_route(request: Request, namespace: str = Depends(request_namespace)):
        async def run() -> Response:
            body = parse_tokenize_request(
                await read_json_body(request),
                trust_request_chat_template=trust_request_chat_template,
            )
            _check_model(body.model)
            answer = await until_disconnect(request, tokenize(engine, body, namespace))
            return JSONResponse(answer)

        return await _answer(run)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        async def run() -> Response:
            body = parse_detokenize_request(await read_json_body(request))
            _check_model(body.model)
            return JSONResponse(await detokenize(engine, body))

        return await _answer(run)

    def _check_model(model: str | None) -> None:
        if model is not None and model not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(
                404,
                f"the model {model[:100]!r} does not exist; this server serves "
                f"{served} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )

    def _check_before_processing(body: SamplingFields) -> SamplingParams:
        """Refuse what needs no prompt to refuse, before any image is fetched or decoded."""
        _check_model(body.model)
        # Every sampling range is checked here; the bound by the prompt's length comes later.
        params = body.to_sampling_params(body.requested_max_tokens, engine.sampling_defaults)
        for field, value in (
            (body.logprobs_field, params.logprobs),
            ("prompt_logprobs", body.prompt_logprobs),
        ):
            if value is not None and value > engine.max_logprobs:
                raise InvalidRequestError(
                    f"{field} is {value} but this server returns at most "
                    f"{engine.max_logprobs} top logprobs (--max-logprobs); ask for fewer, or "
                    "start the server with a larger --max-logprobs",
                    param=field,
                )
        if body.prompt_logprobs is not None and body.stream:
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true (as in vLLM); "
                "send stream: false, or omit prompt_logprobs",
                param="prompt_logprobs",
            )
        return params

    async def _generate(
        request: Request,
        body: SamplingFields,
        requested: SamplingParams,
        prompt: ProcessedPrompt,
        fmt: ResponseFormat | ResponsesFormat,
        events: Callable[..., AsyncIterator[str]] = stream_events,
    ) -> Response:
        params = sampling_params_for(
            body,
            requested,
            len(prompt.prompt_token_ids),
            engine.max_model_len,
            default_max_tokens=engine.sampling_defaults.get("max_tokens"),
        )
        # A stream sends what each step added; a whole answer needs only the last update.
        kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
        outputs = engine.generate(
            prompt, params, fmt.request_id, cache_salt=body.cache_salt, output_kind=kind
        )
        if not body.stream:
            final = await until_disconnect(request, collect_final(outputs))
            raise_if_failed(final)
            return JSONResponse(fmt.response(final))
        try:
            # The first output is awaited here so a refusal still gets a proper status code.
            first = await until_disconnect(request, anext(outputs))
        except BaseException:
            await close_outputs(outputs)
            raise
        if first.finished:
            # Finished before anything was sent: failures still get their own status code.
            try:
                raise_if_failed(first)
            except APIError:
                await close_outputs(outputs)
                raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(events(outputs, first, fmt, include_usage, params.n))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy():
            err = as_api_error(EngineDeadError("health check"))  # 503 engine_dead
            return error_response(err.message, status_code=err.status_code, code=err.code)
        replicas = engine.replica_states()
        if not replicas:  # one engine core: an empty 200, as vLLM answers
            return Response(status_code=200)
        return replica_health(replicas)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(v1)
    return app


async def _answer(run: Callable[[], Any]) -> Response:
    """Run a handler body; every failure becomes an OpenAI-style error response."""
    try:
        return await run()
    except ClientGoneError:
        return Response(status_code=_CLIENT_GONE_STATUS)
    except Exception as exc:
        err = as_api_error(exc)
        return error_response(
            err.message, status_code=err.status_code, code=err.code, param=err.param
        )


async def _parse(request: Request, model: type[BodyT], supported: frozenset[str]) -> BodyT:
    """JSON with limits, then types, then fields we would otherwise silently ignore
    (`supported`: those of the unsupported list this endpoint implements)."""
    data = await read_json_body(request)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    refuse_unsupported_fields(data, supported)
    return body
