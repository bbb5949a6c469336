"""A runner's view of the scheduler's incremental outputs, in plain Python.

The scheduler sends a request in full once (NewRequestData) and then only what changed
(CachedRequestData, and the table entries copy-on-write replaced: `block_copies`).
`RunnerMirror` keeps what a model runner keeps between steps and expands each output back into
one `Scheduled` item per request: its tokens, start, whole block table and whether it samples.
Tests compare those items with the scheduler's own state, so they check that the increments are
enough to rebuild everything, step after step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedserve.scheduler import SamplingParams, Scheduler, SchedulerOutput

UNKNOWN = -1  # a token still being sampled when the step was scheduled


@dataclass(frozen=True)
class Scheduled:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sample: bool
    num_output_tokens: int  # known or in flight before this step's sample
    sampling_params: SamplingParams
    prompt_logprob_token_ids: tuple[int, ...] = ()


@dataclass
class _State:
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    params: SamplingParams
    num_tokens: int  # known ones plus those being sampled
    start: int = 0
    since_step: int = 0  # sent in full in this step: tokens of earlier steps are not its own


@dataclass
class RunnerMirror:
    states: dict[str, _State] = field(default_factory=dict)

    def apply(self, output: SchedulerOutput) -> list[Scheduled]:
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self.states.pop(request_id, None)
        for new in output.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent in full twice"
            self.states[new.request_id] = _State(
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.sampling_params,
                len(new.token_ids),
                new.num_computed_tokens,
                output.step_id,
            )
        cached = output.cached_requests
        for request_id, blocks, start in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[request_id]
            state.block_table.extend(blocks)
            state.start = start
        for request_id, index, _, copy in output.block_copies:  # copy-on-write
            self.states[request_id].block_table[index] = copy
        items = []
        for request_id, num in output.num_scheduled_tokens.items():
            state = self.states[request_id]
            start, end = state.start, state.start + num
            known = state.token_ids + [UNKNOWN] * (state.num_tokens - len(state.token_ids))
            sample = end == state.num_tokens
            prompt_targets: tuple[int, ...] = ()
            if state.params.prompt_logprobs is not None and state.num_tokens == (
                state.num_prompt_tokens
            ):
                prompt_targets = tuple(
                    state.token_ids[start + 1 : min(end, state.num_prompt_tokens - 1) + 1]
                )
            items.append(
                Scheduled(
                    request_id,
                    tuple(known[start:end]),
                    start,
                    tuple(state.block_table),
                    sample,
                    state.num_tokens - state.num_prompt_tokens,
                    state.params,
                    prompt_targets,
                )
            )
            state.start = end
            state.num_tokens += sample
        return items

    def record(self, step_id: int, sampled: Mapping[str, int]) -> None:
        """The tokens step `step_id` sampled, once known (requests dropped since, or sent in full
        again since, are skipped: a runner's row serial does that)."""
        for request_id, token_id in sampled.items():
            state = self.states.get(request_id)
            if (
                state is not None
                and state.since_step <= step_id
                and len(state.token_ids) < state.num_tokens
            ):
                state.token_ids.append(token_id)


@dataclass(frozen=True)
class ExpandedOutput:
    """A SchedulerOutput with its items expanded (`scheduled`), as the tests read it."""

    output: SchedulerOutput
    scheduled: tuple[Scheduled, ...]

    @property
    def num_scheduled_tokens(self) -> int:
        return self.output.total_num_scheduled_tokens

    @property
    def preempted_request_ids(self) -> tuple[str, ...]:
        return self.output.preempted_request_ids

    @property
    def finished_request_ids(self) -> tuple[str, ...]:
        return self.output.finished_request_ids

    @property
    def is_empty(self) -> bool:
        return self.output.is_empty


class MirroredScheduler(Scheduler):
    """A Scheduler whose schedule() returns the expanded items a runner would rebuild."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mirror = RunnerMirror()

    def schedule(self) -> ExpandedOutput:  # type: ignore[override]
        output = super().schedule()
        return ExpandedOutput(output, tuple(self.mirror.apply(output)))

    def update_from_output(self, output, sampled_token_ids):  # type: ignore[override]
        if isinstance(output, ExpandedOutput):
            output = output.output
        self.mirror.record(output.step_id, sampled_token_ids)
        return super().update_from_output(output, sampled_token_ids)
