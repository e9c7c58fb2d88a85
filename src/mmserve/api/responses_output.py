"""The Response object of the Responses API, whole (one JSON answer) and as the stream's
snapshots (`response.created` ... `response.completed`), for one request.

Shapes follow the `openai` package's types (`openai.types.responses.Response`,
`ResponseOutputMessage`, `ResponseOutputText`, `ResponseUsage`). A generation that stopped at
`max_output_tokens` (finish_reason "length") is `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"`, as in OpenAI and vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from mmserve.api.chat_output import AnswerParsing, ChoiceParser
from mmserve.api.responses_protocol import ResponsesRequest
from mmserve.api.responses_tools import function_call_items
from mmserve.engine.frontend.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


class ResponsesFormat:
    """Builds the Response object (and its output items) of one request."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        params: SamplingParams,
        request_id: str,
        parsing: AnswerParsing | None = None,
    ) -> None:
        """`parsing`: the tool calls to read out of the answer (chat's parser)."""
        self.body = body
        self.parsing = parsing
        self.model = model
        self.params = params
        self.request_id = request_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def response(self, final: RequestOutput) -> dict[str, Any]:
        """The whole answer of a finished request (non-streaming)."""
        (choice,) = final.outputs
        status = message_status(choice.finish_reason)
        text, calls = choice.text, []
        if self.parsing is not None:
            message = ChoiceParser(self.parsing).message(choice.text, choice.token_ids)
            text, calls = message.get("content") or "", function_call_items(message)
        output = [self.message(text, status)] if text or not calls else []
        return self.snapshot(status, output=output + calls, usage=usage(final, choice.num_tokens))

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The assistant message output item; its one part holds `text`."""
        content = [output_text(text)] if status != "in_progress" else []
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def snapshot(
        self,
        status: str,
        *,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The Response object in `status` (in_progress, completed, incomplete, failed)."""
        body = self.body
        text_format = body.text.format if body.text is not None else None
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model,
            "output": output or [],
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "metadata": body.metadata,
            "max_output_tokens": body.max_output_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "parallel_tool_calls": True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": {
                "format": (
                    {"type": "text"}
                    if text_format is None
                    else text_format.model_dump(by_alias=True, exclude_none=True)
                )
            },
            "truncation": "disabled",
            "store": False,
            "background": False,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": body.service_tier or "default",
            "user": body.user,
            "usage": usage,
        }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_status(finish_reason: str | None) -> str:
    """A finished message is completed, unless it ran out of tokens."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage(output: RequestOutput, output_tokens: int) -> dict[str, Any]:
    """ResponseUsage: the prompt as the model saw it (placeholders expanded) and the output."""
    input_tokens = len(output.prompt_token_ids)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
