"""Taking blocks back from running requests: preemption by recompute or by swap to the host
pool, resumption from the host pool, and undoing a step that failed on the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.state import SchedulerState

if TYPE_CHECKING:
    from pagedserve.scheduler.outputs import SchedulerOutput
    from pagedserve.scheduler.step_plan import StepPlan


class Preemption(SchedulerState):
    """Preemption and swap (a part of `Scheduler`)."""

    def _swap_in(self, request: Request, plan: StepPlan) -> bool:
        """Resume a swapped request at the head of the queue: its KV comes back from the host
        pool into fresh device blocks, and it goes on from where it was preempted. Returns False
        when the device pool cannot take it yet. Should it never fit (nothing else runs, so no
        blocks will come free), its KV is dropped and it is recomputed like any other."""
        kv = self.kv_cache_manager
        num_new_tokens = min(request.num_tokens - request.num_computed_tokens, plan.token_budget)
        if kv.num_swap_in_blocks(request, num_new_tokens) > kv.num_free_blocks:
            if not self.running:
                kv.drop_swapped(request)
                request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        self._swap_in_copies.extend(kv.swap_in(request))
        new_block_ids = kv.allocate_slots(request, num_new_tokens)
        assert new_block_ids is not None, f"swap-in of {request.request_id!r} found no room"
        self.num_swap_ins += 1
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add_new(request, kv)
        plan.advance(request, num_new_tokens)
        return True

    def _preempt_idle(self, preempted: list[Request]) -> bool:
        """Preempt the latest-admitted running request that awaits a choice (a beam whose
        search waits for its other beams), to recompute later: it holds blocks it computes
        nothing with, and without this a pool full of such beams would admit nobody, their
        searches' other beams included. Returns False when there is none."""
        for request in reversed(self.running):
            if request.awaiting_choice:
                self.running.remove(request)
                self._preempt(request)
                preempted.append(request)
                return True
        return False

    def _preempt(self, request: Request, swap: bool = False) -> None:
        """Take a running request's blocks and requeue it first. With `swap` (a preemption
        for room, in swap mode) its KV moves to the host pool when that has room, and it
        resumes where it was; otherwise its blocks are freed and it recomputes later."""
        copies = self.kv_cache_manager.swap_out(request) if swap else None
        if copies is None:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        else:
            self._swap_out_copies.extend(copies)
            self.num_swap_outs += 1
        request.status = RequestStatus.PREEMPTED
        request.send_in_full = False  # it will be, when readmitted
        request.spec_token_ids = ()  # a step undone: its drafts never come back
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def undo_step(self, output: SchedulerOutput) -> None:
        """Forget a step that failed before it produced anything (the device ran out of memory):
        its sampling placeholders are dropped, and every request it scheduled that still runs is
        preempted, to recompute later. The prefix cache is emptied, since blocks cached when the
        step's slots were granted never received their KV."""
        for request in self._sampling.pop(output.step_id, ()):
            request.num_output_placeholders -= 1
        # In reverse: each preempted request goes to the head of the queue, so they keep their
        # order there.
        for request_id in reversed(output.num_scheduled_tokens):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._preempt(request)
            self._preempted_since_schedule.append(request_id)
        # The step's swap-out copies may not have run: no swapped KV is trusted, so every
        # swapped request recomputes.
        for request in self.waiting:
            if self.kv_cache_manager.drop_swapped(request):
                request.num_computed_tokens = 0
        self.kv_cache_manager.reset_prefix_cache()
