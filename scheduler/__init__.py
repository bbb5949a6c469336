"""Requests, sampling parameters, the KV block pool and the continuous-batching scheduler.

Pure Python (stdlib only): no torch, so all of it is unit-testable in milliseconds. It speaks to
the engine in frozen data (outputs.py) and holds no tensor: the KV lives in the worker, which
does what a `SchedulerOutput` says.

A step. Every request has one progress counter, `num_computed_tokens`: prefill, chunked
prefill, decode, prefix-cache hits and recompute after preemption all catch it up to
`num_tokens`. `Scheduler.schedule` gives the running requests their tokens first, oldest first,
preempting the latest admitted when the pool runs out (a request may preempt itself); only if
nothing was preempted it admits waiting ones in queue order, reusing their prefix-cache hits,
until one does not fit (no overtaking; a request waiting for its grammar, its beam search's
choice or an adapter slot is passed by); then it builds the output. The counter advances at
schedule(); `update_from_output` appends the sampled tokens, applies the stop rules and frees
finished requests at once. Stop strings need text: the front end finds them and the core ends
the sample (`finish_request`). Where each phase lives: scheduler.py's `Scheduler` docstring.

The KV memory. `KVCacheManager` is the scheduler's only view of it (its docstring holds the
invariants: tables, sliding windows, ref counts, copy-on-write, caching before the KV is
computed); the layout of KV-cache groups is kv_groups.py's; the pool, its LRU free list and lazy
eviction are block_pool.py's; the prefix cache's keys (sha256 chains that keep the token ids, so
a digest collision cannot hit) are block_hash.py's. The pool holds at least one request of
max_model_len tokens in every group (config.py), or a long request could preempt everyone,
itself included, and never finish.

Requests that share blocks, each through ref counts and copy-on-write:
- n > 1: the samples of one prompt are attached to the first and fork its blocks once its first
  token is back (`Scheduler.add_request`);
- beam search: beams fork their beam's blocks every round (`Scheduler.fork_request`; the search
  itself is engine/core/beam_search.py); beams that wait for their search's choice compute
  nothing and are the first preempted when the queue's head finds no room;
- rewind: the last tokens go back and the blocks past the new end are freed (`Scheduler.rewind`,
  `KVCacheManager.truncate`);
- n-gram drafts: proposed before a decode step and scheduled as extra tokens; the rejected ones'
  progress is taken back (speculation.py, ngram.py);
- swap preemption: a preempted request's blocks move to a host pool and back (preemption.py,
  kv_swap.py); the runner copies swap-outs, then copy-on-write copies, then swap-ins, before the
  step runs.
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
