"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    """One of the n samples of a request. `text` only grows: text that could still turn out to be
    the start of a stop string is held back until it is known not to be (or the sample ends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per token: chosen token + top-k
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # When SamplingParams.prompt_logprobs is set: one entry per prompt token, None for the first
    # (nothing predicts it), else that token + the top-k like CompletionOutput.logprobs. Shared by
    # the n samples; present and complete from the first snapshot with output tokens on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
