"""Plain frozen data the scheduler hands to the engine (no live objects cross over)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import RequestStatus
from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids[j]` sits at position `start_position + j`; its KV goes to slot
    `block_table[p // block_size] * block_size + p % block_size` with p that position.
    `start_position` is the request's num_computed_tokens before this step, so attention
    for these tokens covers positions [0, start_position + len(token_ids)).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]  # the whole table after this step's allocation
    sampling_params: SamplingParams
    # True when this step reaches the end of the known tokens, so the runner must sample a
    # next token from the last position; False for a non-final chunk of a chunked prefill.
    sample: bool
    num_output_tokens: int  # generated so far (lets the runner derive per-position seeds)
    # Prompt logprobs (sampling_params.prompt_logprobs set): the hidden state of token_ids[j]
    # predicts prompt_logprob_token_ids[j], the prompt token at position start_position + j + 1,
    # so a chunk yields the entries of positions start_position + 1 onwards, one per id:
    #
    #     position     s     s+1   ...  e-1  |  e      (e = start_position + len(token_ids))
    #     token_ids    t_s   t_s+1 ...  t_e-1 |
    #     predicts     t_s+1 t_s+2 ...  t_e   |         (t_e: the next chunk's first token)
    #
    # Cut at the prompt's end (the last prompt position predicts the first output token, which
    # is sampled, not scored), and empty once the request has an output token: all prompt
    # positions were scored before it was sampled, so a recompute after preemption skips them.
    prompt_logprob_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step."""

    scheduled: tuple[ScheduledRequest, ...]  # running requests first, then newly admitted
    num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...]
    # Finished or aborted since the previous schedule(): the runner may drop their state.
    finished_request_ids: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute and nothing to tell the runner.

        A non-empty output may still schedule no tokens (only finished or preempted ids,
        for the runner to drop per-request state): check `scheduled` before building a batch.
        """
        return not (self.scheduled or self.preempted_request_ids or self.finished_request_ids)


@dataclass(frozen=True)
class RequestDelta:
    """What changed for one request in update_from_output / finish_request / abort."""

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
