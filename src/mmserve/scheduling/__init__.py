"""Scheduling stage of mmserve: requests, KV blocks, encoder cache, and the step planner."""

from mmserve.scheduling.encoder_cache_manager import EncoderCacheManager
from mmserve.scheduling.kv_cache_manager import KVCacheManager
from mmserve.scheduling.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from mmserve.scheduling.request import Request
from mmserve.scheduling.scheduler import Scheduler
from mmserve.updates import RequestStatus, RequestUpdate

__all__ = [
    "CachedRequestData",
    "EncoderCacheManager",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
