"""Messages that cross a process, and their codec: plain data, raw array frames, no pickle.

The values inside a message (SamplingParams, RequestUpdate, SchedulerStats, ...) are the
engine's own msgspec structs; this package holds only the codec and the envelopes. See
docs/wire.md for each message, the frame layout and what decoding checks.
"""

from mmserve.wire.codec import ALLOWED_DTYPES, MESSAGE_TAGS, Message, decode, encode
from mmserve.wire.common import WireError
from mmserve.wire.engine_core import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MESSAGE_TAGS",
    "EngineCoreAbort",
    "EngineCoreOutputs",
    "EngineCoreReady",
    "EngineCoreRequest",
    "EngineCoreShutdown",
    "EngineDead",
    "Message",
    "WireError",
    "decode",
    "encode",
]
