"""Messages that cross a process, and their codec: plain data, raw array frames, no pickle.

See docs/wire.md for each message, the frame layout and what decoding checks.
"""

from mmserve.wire.codec import ALLOWED_DTYPES, MESSAGE_TAGS, Message, decode, encode
from mmserve.wire.common import (
    WireEncoderInput,
    WireError,
    WireLogprobs,
    WireMMFeature,
    WireRemoteItem,
    WireRequestFailure,
    WireSamplingParams,
    WireStructuredOutputs,
)
from mmserve.wire.engine_core import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
    EngineStats,
)
from mmserve.wire.executor import (
    WireCachedRequestData,
    WireGrammarBitmask,
    WireModelRunnerOutput,
    WireNewRequestData,
    WireRemoteEncoderInput,
    WireRunnerPayload,
    WireSchedulerOutput,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MESSAGE_TAGS",
    "EngineCoreAbort",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReady",
    "EngineCoreRequest",
    "EngineCoreShutdown",
    "EngineDead",
    "EngineStats",
    "Message",
    "WireCachedRequestData",
    "WireEncoderInput",
    "WireGrammarBitmask",
    "WireLogprobs",
    "WireError",
    "WireMMFeature",
    "WireModelRunnerOutput",
    "WireRemoteItem",
    "WireNewRequestData",
    "WireRemoteEncoderInput",
    "WireRemoteItem",
    "WireRequestFailure",
    "WireRunnerPayload",
    "WireSamplingParams",
    "WireSchedulerOutput",
    "WireStructuredOutputs",
    "decode",
    "encode",
]
