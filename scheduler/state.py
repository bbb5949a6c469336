"""What the scheduler knows between steps, declared once for the files it is written in
(scheduler.py, preemption.py, speculation.py, forks.py, each a part of `Scheduler`)."""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request


class SchedulerState:
    """The queues, the KV-cache manager and the counters of a `Scheduler`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_group_windows,
            config.num_host_blocks,
        )
        # Live requests only (waiting, running, preempted); finished ones leave at once.
        self.requests: dict[str, Request] = {}
        # Preempted requests sit at the front, so they resume before newer arrivals.
        self.waiting: deque[Request] = deque()
        # Admission order: the tail is the first to be preempted.
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Swap preemption: preemptions that moved the request's KV to the host pool (the rest
        # recomputed), resumptions that moved it back, and this step's copies for the runner.
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self._swap_out_copies: list[tuple[int, int]] = []
        self._swap_in_copies: list[tuple[int, int]] = []
        # Speculative decoding: drafts scheduled, and accepted, in the steps applied so far.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Samples attached to a parent sample (add_request's fork_parent), in no queue yet.
        self._num_attached = 0
        self._finished_since_schedule: list[str] = []
        # Taken out of the batch by undo_step or rewind, for the runner to drop.
        self._preempted_since_schedule: list[str] = []
        # Per step not yet applied by update_from_output: the requests it samples for.
        self._step_id = 0
        self._sampling: dict[int, list[Request]] = {}
