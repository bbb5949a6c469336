"""Requests, sampling parameters, the KV block pool and the continuous-batching scheduler.

Pure Python (stdlib only): no torch, so all of it is unit-testable in milliseconds.
"""

from __future__ import annotations

from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    SchedulerOutput,
)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputs
from pagedserve.scheduler.scheduler import Scheduler

__all__ = [
    "Block",
    "CachedRequestData",
    "BlockPool",
    "KVCacheManager",
    "LoRARequest",
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
