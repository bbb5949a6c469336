"""Requests, sampling parameters, the KV block pool and the continuous-batching scheduler.

Pure Python (stdlib only): no torch, so all of it is unit-testable in milliseconds.
"""

from __future__ import annotations

from scheduler.block_pool import Block, BlockPool
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputs
from scheduler.scheduler import Scheduler

__all__ = [
    "Block",
    "CachedRequestData",
    "BlockPool",
    "KVCacheManager",
    "Request",
    "RequestDelta",
    "RequestStatus",
    "SamplingParams",
    "NewRequestData",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StructuredOutputs",
]
