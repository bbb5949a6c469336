"""One generation request as the scheduler tracks it: tokens, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life-cycle state of a request.

    Ordered on purpose: every status greater than PREEMPTED is a finished one, so
    `status > RequestStatus.PREEMPTED` (or `status.is_finished`) is the finished test.
    """

    WAITING = 0
    # Queued, but not admitted before its grammar (structured outputs) has compiled: the
    # scheduler passes it by (as vLLM's WAITING_FOR_FSM) until `Scheduler.grammar_ready`.
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the engine failed this request alone (non-finite logits, out of memory)

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* states."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """`finish_reason` ("stop" | "length" | "abort" | "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A single sequence being generated (the engine fans `n > 1` out into several).

    Progress is one counter, `num_computed_tokens`: the number of leading tokens of
    `all_token_ids` whose KV is in the cache (or is being computed in the current step).
    Prefill, chunked prefill, decode, prefix-cache hits and recompute after preemption are
    all "advance num_computed_tokens to num_tokens".

    Invariant: `all_token_ids == prompt_token_ids + output_token_ids`, maintained by
    `append_output_token_ids` so that reading it never costs a concatenation. With
    asynchronous scheduling `num_computed_tokens` may run ahead of `num_tokens` by the
    `num_output_placeholders` tokens still being sampled.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "eos_token_ids",
        "finishing_token_ids",
        "status",
        "num_computed_tokens",
        "arrival_time",
        "num_preemptions",
        "num_output_placeholders",
        "spec_token_ids",
        "ngram_index",
        "fork_parent",
        "fork_children",
        "send_in_full",
        "pause_after_sample",
        "awaiting_choice",
        "encoder_input",
        "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        encoder_input: object | None = None,
        waiting_for_grammar: bool = False,
        lora: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        # The ids that end the request when sampled: its stop tokens, and EOS unless ignored.
        finishing = frozenset(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            finishing |= self.eos_token_ids
        self.finishing_token_ids: frozenset[int] = finishing
        self.status = (
            RequestStatus.WAITING_FOR_GRAMMAR if waiting_for_grammar else RequestStatus.WAITING
        )
        self.num_computed_tokens = 0
        # Wall-clock seconds (time.time()), like vLLM, so it can be compared across processes.
        self.arrival_time: float = time.time() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        # Tokens being sampled in steps whose results update_from_output has not applied yet
        # (at most one with asynchronous scheduling, which schedules step N + 1 before step N's
        # tokens are back): their positions are scheduled, their ids unknown on the host.
        self.num_output_placeholders = 0
        # Speculative decoding: the drafts scheduled in the step not yet applied, and the
        # request's n-gram index (built at its first proposal).
        self.spec_token_ids: tuple[int, ...] = ()
        self.ngram_index = None
        # Samples of one prompt (n > 1): the others wait attached to the first, the parent,
        # until its prompt is computed, then fork its blocks (Scheduler.add_request).
        self.fork_parent: Request | None = None
        self.fork_children: list[Request] = []
        # Running, but the runner has no current state for it (forked, or rewound): its next
        # schedule() sends it as a NewRequestData.
        self.send_in_full = False
        # Not scheduled again while a token of it is being sampled (a beam waits for the beam
        # search's choice, which may replace that token).
        self.pause_after_sample = False
        # A paused request whose token came back: it computes nothing more (running or queued)
        # until its owner decides (a beam search keeps it and clears this, or ends it). Beams of
        # one search report in different steps once preemption has split them up.
        self.awaiting_choice = False
        # An encoder-decoder's request (Whisper): what the runner's encoder turns into its
        # cross-attention KV (opaque here), which holds SchedulerConfig.encoder_blocks blocks.
        self.encoder_input = encoder_input
        # The LoRA adapter the request runs with (None: the base model).
        self.lora = lora

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length: the target `num_computed_tokens` catches up to."""
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request stopped, hit a length limit or was aborted."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort", or None while the request is live."""
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated token(s) to both `output_token_ids` and `all_token_ids`."""
        new_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.output_token_ids.extend(new_ids)
        self.all_token_ids.extend(new_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_output_tokens={self.num_output_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
