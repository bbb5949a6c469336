"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample.

Whether an output holds everything so far or only what is new depends on the request's
`SamplingParams.output_kind`; `RequestOutput.add` folds "delta" outputs back into a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


def greedy_top(entry: dict[int, Logprob]) -> int:
    """The token greedy decoding takes from one position's logprobs ({id: Logprob}, as prompt
    logprobs list them: the scored token and the top ones). A token tied with the top shares its
    rank 1, and greedy takes the lowest id of them; so does this. (bfloat16 logits tie often:
    counting the scored token whenever it ties flattered logits rounded to bfloat16, by 1-1.5
    points of teacher-forced agreement.)"""
    return min(entry.items(), key=lambda kv: (kv[1].rank, kv[0]))[0]


@dataclass
class CompletionOutput:
    """One of the n samples of a request. `text` only grows: text that could still turn out to be
    the start of a stop string is held back until it is known not to be (or the sample ends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
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
    # the n samples; complete in the first output with output tokens (a "delta" output carries
    # them once).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when the engine failed this request alone (NaN logits, out of memory, an exception
    # while detokenizing): the failed sample has finish_reason "error", the others "abort".
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold the next "delta" output of the same request into this one (in place)."""
        samples = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            sample = samples.get(new.index)
            if sample is None:
                sample = samples[new.index] = CompletionOutput(
                    index=new.index, logprobs=None if new.logprobs is None else []
                )
                self.outputs.append(sample)
            sample.text += new.text
            sample.token_ids.extend(new.token_ids)
            if new.logprobs is not None and sample.logprobs is not None:
                sample.logprobs.extend(new.logprobs)
            sample.cumulative_logprob = new.cumulative_logprob
            sample.finish_reason = new.finish_reason
            sample.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.error = delta.error
        self.first_token_time = delta.first_token_time
        self.finished_time = delta.finished_time


@dataclass
class PoolingOutput:
    """An embedding model's answer to one request: its prompt's pooled vector (float32, as the
    model's pooling config makes it: engine/models/bert_config.py `PoolingConfig`). Always the
    request's one and final output."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: np.ndarray
    finished: bool = True
    arrival_time: float = 0.0
    finished_time: float | None = None
    error: str | None = None  # (never set: a failed request ends with a RequestOutput)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """No sample was generated: one empty sample, finished ("stop"), so that what reads a
        request's samples (the server's metrics) counts the request as done."""
        return [CompletionOutput(index=0, finish_reason="stop")]


@dataclass
class BeamSearchSequence:
    """One result of `LLM.beam_search`: the generated tokens (the prompt not included)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what ranks them
    finish_reason: str  # "stop" (it ended in EOS) | "length"


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
