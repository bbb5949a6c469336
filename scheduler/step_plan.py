"""One step as schedule() decides it: the budgets left and what has been granted so far."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.scheduler.request import Request

if TYPE_CHECKING:
    from pagedserve.scheduler.kv_cache_manager import KVCacheManager


@dataclass
class StepPlan:
    """The scratch state of one schedule() call, passed from phase to phase (mutable, and
    dropped once the step's SchedulerOutput is built).

    `token_budget` and `prefill_left` (None: only the token budget limits prompt tokens) are
    what the step may still take; the rest is what it has granted, in the order granted: that
    order is the batch's.
    """

    token_budget: int
    prefill_left: int | None
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Requests the runner has a row for: their ids, new block ids and first position (filled by
    # the hot loop of Scheduler._schedule_running).
    cached_ids: list[str] = field(default_factory=list)
    cached_new_blocks: list[tuple[int, ...]] = field(default_factory=list)
    cached_starts: list[int] = field(default_factory=list)
    # Requests sent in full: admitted, swapped in, forked or rewound.
    new_requests: list[NewRequestData] = field(default_factory=list)
    sampling: list[Request] = field(default_factory=list)  # those whose chunk samples a token
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # The budget charged for encoder passes, which compute no scheduled tokens.
    encoder_charge: int = 0

    def add_new(self, request: Request, kv: KVCacheManager, encode: bool = False) -> None:
        """Send the request in full, to a runner that has no state for it (before `advance`);
        `encode`: its encoder blocks are new, for the runner to fill from its encoder input."""
        self.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=tuple(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=tuple(kv.get_block_ids(request.request_id)),
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params,
                encoder_block_ids=tuple(kv.encoder_block_ids(request.request_id)),
                encoder_input=request.encoder_input if encode else None,
                lora=request.lora,
            )
        )

    def advance(self, request: Request, num_new_tokens: int) -> None:
        """Record the request's share of the step and advance its progress counter; a chunk
        that reaches the end of its tokens samples the next one (a placeholder until
        update_from_output brings it)."""
        self.num_scheduled[request.request_id] = num_new_tokens
        request.num_computed_tokens += num_new_tokens
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            self.sampling.append(request)

    def output(
        self,
        step_id: int,
        max_num_batched_tokens: int,
        preempted_ids: tuple[str, ...],
        finished_ids: tuple[str, ...],
        block_copies: tuple[tuple[str, int, int, int], ...],
        swap_out: tuple[tuple[int, int], ...],
        swap_in: tuple[tuple[int, int], ...],
    ) -> SchedulerOutput:
        """The step's output: what it granted, and what the scheduler says changed since the
        last step (the budget left, encoder charges aside, is what was not scheduled)."""
        return SchedulerOutput(
            step_id=step_id,
            new_requests=tuple(self.new_requests),
            cached_requests=CachedRequestData(
                tuple(self.cached_ids), tuple(self.cached_new_blocks), tuple(self.cached_starts)
            ),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=(
                max_num_batched_tokens - self.token_budget - self.encoder_charge
            ),
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            spec_token_ids=self.spec_tokens,
            block_copies=block_copies,
            swap_out=swap_out,
            swap_in=swap_in,
        )


def prefill_cap(
    config: SchedulerConfig, running: Sequence[Request], num_waiting: int
) -> int | None:
    """How many prompt tokens a step may take, when some running request decodes (one token to
    compute) and `max_prefill_tokens_while_decoding` is set; else None.

    The budget is shared per request: prompts get the waiting and prefilling requests' share of
    it, and never less than the cap. So a stream or two decoding while a burst of prompts
    arrives barely slows the burst (one stall for few streams), while many streams decoding as
    one long prompt arrives stall for at most the cap's worth of prefill per step."""
    cap = config.max_prefill_tokens_while_decoding
    if not cap:
        return None
    decoding = prefilling = 0
    for request in running:
        left = len(request.all_token_ids) + request.num_output_placeholders
        left -= request.num_computed_tokens
        if left == 1:
            decoding += 1
        elif left > 1:
            prefilling += 1
    if not decoding:
        return None
    wanting = prefilling + num_waiting
    share = config.max_num_batched_tokens * wanting // (wanting + decoding)
    return max(cap, share)
