"""Plain frozen data the scheduler hands to the engine (no live objects cross over).

A step's output is incremental, as in vLLM v1: a request is sent in full once, when it is
admitted (or re-admitted after preemption), and afterwards only what changed: the blocks
appended to its table and where its new tokens start. The model runner keeps each running
request's tokens and block table between steps (engine/worker/input_batch.py), so the per-step cost
does not grow with context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: admitted this step, or resumed after preemption.

    `token_ids` are all its known tokens (the prompt, then the outputs of a resumed request);
    this step computes `token_ids[num_computed_tokens : num_computed_tokens + n]` with n its
    entry in `SchedulerOutput.num_scheduled_tokens`. Positions below num_computed_tokens are
    prefix-cache hits, already in the cache.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_ids: tuple[int, ...]  # the whole table after this step's allocation
    num_computed_tokens: int
    sampling_params: SamplingParams
    # An encoder-decoder's request: its cross-attention blocks (fixed for its life), and the
    # encoder's input when the step is to encode it into them (at admission, and again after a
    # preemption freed them; not when only the runner's state for it is rebuilt).
    encoder_block_ids: tuple[int, ...] = ()
    encoder_input: object | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass(frozen=True)
class CachedRequestData:
    """The requests scheduled in an earlier step and still running, as parallel tuples (one
    object per step, not per request: a decode step of 256 requests builds three tuples).

    Row i: request `request_ids[i]` appends `new_block_ids[i]` (usually empty) to its table and
    computes its tokens from position `num_computed_tokens[i]` on. Those tokens are ones the
    runner already has: sampled by it in an earlier step, the last one possibly still on the
    device when scheduling runs ahead (asynchronous scheduling).
    """

    request_ids: tuple[str, ...] = ()
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    num_computed_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step.

    The batch order is `num_scheduled_tokens`' order: the cached (running) requests first, then
    the new ones. A request samples a token when its chunk reaches the end of its tokens
    (including a token still being sampled); the runner knows both numbers.
    """

    step_id: int  # increasing; update_from_output matches a step's samples by it
    new_requests: tuple[NewRequestData, ...]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...]
    # Finished or aborted since the previous schedule(): the runner may drop their state.
    finished_request_ids: tuple[str, ...]
    # Speculative decoding: the draft tokens of the requests that have some this step. Such a
    # request's scheduled tokens are its last token then the drafts; the runner returns the
    # drafts it accepted and one more token (update_from_output's `accepted_token_ids`).
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Copy-on-write, before the step runs: (request id, index in its table, source block id,
    # destination block id). The runner copies each source block into its destination (every
    # layer) and sets the table entry of a request it already has; a new request's block_ids
    # hold the destination already.
    block_copies: tuple[tuple[str, int, int, int], ...] = ()
    # Swap preemption, as (source block id, destination block id) pairs. `swap_out`: device
    # blocks of requests preempted this step into host blocks; copied first, before anything
    # of this step writes into the device blocks they leave. `swap_in`: host blocks into the
    # device blocks of requests resumed this step (sent in full, the destinations in their
    # block_ids); copied after the copy-on-write copies, before the forward pass. A step never
    # has both: nothing is admitted in a step that preempts.
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute and nothing to tell the runner.

        A non-empty output may still schedule no tokens (only finished or preempted ids,
        for the runner to drop per-request state): check `num_scheduled_tokens` before
        building a batch.
        """
        return not (
            self.num_scheduled_tokens or self.preempted_request_ids or self.finished_request_ids
        )


class RequestDelta(NamedTuple):
    """What changed for one request in update_from_output / finish_request / abort (a tuple:
    one is built per request per step, and a frozen dataclass costs several times more)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    status: RequestStatus
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        """True when this is the request's last delta."""
        return self.status.is_finished

    @classmethod
    def of(cls, request: Request, new_token_ids: tuple[int, ...]) -> RequestDelta:
        """The request's delta as it stands, with `new_token_ids` its new tokens."""
        return cls(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            status=request.status,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )
