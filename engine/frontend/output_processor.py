"""The front end's half of generation: a request's n samples, their text and their outputs.

`OutputProcessor.add` turns a request into the samples the engine core schedules; `process`
applies what a core step produced: token ids and logprobs, incremental detokenization, stop
strings (which the core cannot see: it gets the ids back to end), and one RequestOutput per
request in its `SamplingParams.output_kind`. It runs wherever the tokenizer is: in the caller's
process with LLMEngine, in the API server's with the core in its own process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pagedserve.engine.frontend.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from pagedserve.engine.frontend.inputs import NewRequest, bad_words_token_ids
from pagedserve.engine.frontend.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    RequestOutput,
)
from pagedserve.engine.messages import CoreRequest, SampleOutput, TokenLogprobs
from pagedserve.scheduler import SamplingParams

logger = logging.getLogger("pagedserve")


@dataclass
class _Sample:
    """Engine-side state of one sample (one scheduler request)."""

    parent: _Parent
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    full_text: str = ""  # everything detokenized so far (may end in held-back text)
    # What earlier "delta" outputs carried: tokens, text characters, and the finish.
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finished: bool = False

    def delta(self) -> CompletionOutput | None:
        """What is new since the previous delta output, or None when nothing is."""
        out = self.output
        if (
            len(out.token_ids) == self.sent_tokens
            and len(out.text) == self.sent_text
            and out.finished == self.sent_finished
        ):
            return None
        delta = CompletionOutput(
            index=out.index,
            text=out.text[self.sent_text :],
            token_ids=out.token_ids[self.sent_tokens :],
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=None if out.logprobs is None else out.logprobs[self.sent_tokens :],
            cumulative_logprob=out.cumulative_logprob,
        )
        self.sent_tokens, self.sent_text = len(out.token_ids), len(out.text)
        self.sent_finished = out.finished
        return delta


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample] = field(default_factory=list)
    first_token_time: float | None = None
    # With params.prompt_logprobs: one entry per prompt position (position 0 stays None), filled
    # as sample 0's prefill chunks are scored; a position scored again in a recompute after
    # preemption keeps its first entry. Complete once num_prompt_logprobs == len(prompt) - 1.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_prompt_logprobs: int = 0
    sent_prompt_logprobs: bool = False  # a delta output carried them already
    error: str | None = None  # why the request failed (a sample ended with finish "error")

    def output(self, finished: bool) -> RequestOutput | None:
        """This step's output in the request's `output_kind`, or None when it has none. A
        request that picks its n outputs among more samples (best_of > n) has one output, when it
        finishes."""
        kind = self.params.output_kind
        picks = self.params.num_samples > self.params.n
        if (kind == "final" or picks) and not finished:
            return None
        if picks:
            return self._request_output(self._best(), finished)
        prompt_logprobs = (
            self.prompt_logprobs
            if self.num_prompt_logprobs == len(self.prompt_token_ids) - 1
            else None
        )
        if kind == "delta":
            outputs = [d for s in self.samples if (d := s.delta()) is not None]
            if prompt_logprobs is not None:
                if self.sent_prompt_logprobs:
                    prompt_logprobs = None
                self.sent_prompt_logprobs = True
        elif kind == "final":  # the request is done with its outputs: hand them over
            outputs = [s.output for s in self.samples]
        else:
            outputs = [
                CompletionOutput(
                    index=s.output.index,
                    text=s.output.text,
                    token_ids=list(s.output.token_ids),
                    finish_reason=s.output.finish_reason,
                    stop_reason=s.output.stop_reason,
                    logprobs=None if s.output.logprobs is None else list(s.output.logprobs),
                    cumulative_logprob=s.output.cumulative_logprob,
                )
                for s in self.samples
            ]
        return self._request_output(outputs, finished, prompt_logprobs)

    def _best(self) -> list[CompletionOutput]:
        """best_of: the n samples with the highest cumulative logprob, renumbered 0..n-1 (the
        logprobs each sample computed for this are dropped unless the request asked for them)."""
        ranked = sorted(
            (s.output for s in self.samples), key=lambda c: -(c.cumulative_logprob or 0.0)
        )
        keep_logprobs = self.params.logprobs is not None
        return [
            dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
            for i, c in enumerate(ranked[: self.params.n])
        ]

    def _request_output(
        self,
        outputs: list[CompletionOutput],
        finished: bool,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=time.time() if finished else None,
            prompt_logprobs=prompt_logprobs,
            error=self.error,
        )


class OutputProcessor:
    """Front-end state of every unfinished request. Not thread-safe: one owner at a time."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, request: NewRequest) -> list[CoreRequest]:
        """Register a request whose inputs were checked; return its n samples for the core."""
        request_id, prompt, params = request.request_id, request.prompt, request.params
        assert request_id not in self._parents, f"request id {request_id!r} is already in use"
        if params.bad_words and not params.bad_words_token_ids:
            # The core knows token ids only: the words become ids here, once per request.
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = params.clone(bad_words_token_ids=words)
        prompt_token_ids = prompt.token_ids
        parent = _Parent(request_id, prompt.text, prompt_token_ids, params, request.arrival_time)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        samples = []
        num_samples = params.num_samples
        for k in range(num_samples):
            # Sample k of a seeded request gets seed + k, so the n samples differ but reproduce.
            child_params = (
                params if params.seed is None or k == 0 else params.clone(seed=params.seed + k)
            )
            if num_samples > 1:
                # The samples share the prompt: sample 0 alone scores it; the others fork its
                # blocks (EngineCore.add_samples).
                child_params = child_params.clone(
                    n=1, best_of=None, prompt_logprobs=params.prompt_logprobs if k == 0 else None
                )
            if num_samples > params.n and child_params.logprobs is None:
                # best_of ranks by cumulative logprob: each sample must report its tokens'.
                child_params = child_params.clone(logprobs=0)
            child_id = _child_id(request_id, k)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            output = CompletionOutput(
                index=k,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            sample = _Sample(parent, output, detok)
            parent.samples.append(sample)
            self._samples[child_id] = sample
            samples.append(
                CoreRequest(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    parent.arrival_time,
                    prompt.encoder_input,
                    request.lora,
                )
            )
        self._parents[request_id] = parent
        return samples

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Forget a request: its last output (finish "abort" for unfinished samples; None for an
        unknown id) and the ids of its samples, for the core to abort."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None, []
        child_ids = []
        for k, sample in enumerate(parent.samples):
            child_id = _child_id(request_id, k)
            child_ids.append(child_id)
            self._samples.pop(child_id, None)
            if not sample.output.finished:
                sample.output.finish_reason = "abort"
        return parent.output(finished=True), child_ids

    def live_sample_ids(self, request_id: str) -> list[str]:
        """The ids of the request's unfinished samples (for a rewind); ValueError when it is
        unknown or has none."""
        parent = self._parents.get(request_id)
        live = [] if parent is None else [
            _child_id(request_id, s.output.index) for s in parent.samples if not s.output.finished
        ]  # fmt: skip
        if not live:
            raise ValueError(f"request {request_id!r} is unknown or finished")
        return live

    def process(
        self, outputs: list[SampleOutput]
    ) -> tuple[list[RequestOutput | PoolingOutput], list[str]]:
        """Apply a core step's outputs. Returns an output for every request with something new
        (in its output kind) and the ids of samples a stop string ended, for the core to stop.
        Outputs for samples already finished here (a stop string the core has not heard of yet)
        are dropped."""
        now = time.time()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        pooled: list[PoolingOutput] = []
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None or sample.output.finished:
                continue
            parent = sample.parent
            if out.embedding is not None:  # an embedding request ends with its vector
                self._release(parent)
                vector = np.frombuffer(out.embedding, dtype="<f4")
                pooled.append(
                    PoolingOutput(
                        parent.request_id,
                        parent.prompt_token_ids,
                        vector,
                        arrival_time=parent.arrival_time,
                        finished_time=now,
                    )
                )
                continue
            if out.rewound_to is not None:
                self._rewind(sample, out.rewound_to)
                touched[parent.request_id] = parent
            if out.prompt_logprobs is not None:
                self._record_prompt_logprobs(parent, *out.prompt_logprobs)
            if out.new_token_ids and parent.first_token_time is None:
                parent.first_token_time = now
            if out.finish_reason == "error":
                stopped += self._fail(parent, sample, out.error or "the engine failed")
                touched[parent.request_id] = parent
            elif out.new_token_ids or out.finish_reason is not None:
                try:
                    if self._append(sample, out):
                        stopped.append(out.request_id)
                except Exception as exc:  # e.g. the tokenizer fails on these ids: this request
                    logger.exception("request %s: processing its output failed", parent.request_id)
                    reason = f"processing the output failed: {type(exc).__name__}: {exc}"
                    stopped += self._fail(parent, sample, reason)
                touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            finished = all(s.output.finished for s in parent.samples)
            if finished:
                self._release(parent)
            output = parent.output(finished)
            if output is not None:
                results.append(output)
        return pooled + results, stopped

    def _append(self, sample: _Sample, delta: SampleOutput) -> bool:
        """Add a step's tokens and text to a sample; True when a stop string ended it here (the
        core still runs it)."""
        out = sample.output
        params = sample.parent.params
        out.token_ids.extend(delta.new_token_ids)
        logprobs = delta.logprobs
        if logprobs is not None:
            if out.logprobs is not None:
                out.logprobs.append(self._logprob_entry(delta.new_token_ids[-1], logprobs))
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + logprobs[0]
        elif delta.cumulative_logprob is not None:  # a beam, whole at the end
            out.cumulative_logprob = delta.cumulative_logprob

        finished = delta.finish_reason is not None
        if finished:
            out.finish_reason = delta.finish_reason
            last = delta.new_token_ids[-1] if delta.new_token_ids else None
            if delta.finish_reason == "stop" and last in params.stop_token_ids:
                out.stop_reason = last
        new_text = sample.detokenizer.add_tokens(delta.new_token_ids)
        if finished:
            new_text += sample.detokenizer.flush()  # bytes held for an unfinished character
        checked_from = len(sample.full_text)
        sample.full_text += new_text
        visible_end = len(sample.full_text)
        stopped_here = False
        if params.stop:
            # Before min_tokens output tokens a stop string does not end the output (vLLM's
            # rule); that text counts as checked, so it never does later either.
            hit = (
                find_stop(sample.full_text, params.stop, checked_from)
                if len(out.token_ids) > params.min_tokens
                else None
            )
            if hit is not None:
                start, stop_str = hit
                visible_end = start + len(stop_str) if params.include_stop_str_in_output else start
                stopped_here = not finished
                # A stop string completed by the last allowed token still counts as a stop.
                out.finish_reason, out.stop_reason = "stop", stop_str
            elif not finished:
                visible_end -= stop_holdback(sample.full_text, params.stop)
        out.text = sample.full_text[: max(visible_end, len(out.text))]
        return stopped_here

    def _rewind(self, sample: _Sample, num_tokens: int) -> None:
        """Cut a sample back to its first `num_tokens` output tokens, as the core did: tokens,
        logprobs and text (detokenized again from the prompt; what could start a stop string is
        held back as usual). A "delta" consumer is not told: its next deltas continue from
        there."""
        out = sample.output
        parent = sample.parent
        del out.token_ids[num_tokens:]
        if out.logprobs is not None:
            del out.logprobs[num_tokens:]
            out.cumulative_logprob = sum(
                entry[token].logprob
                for token, entry in zip(out.token_ids, out.logprobs, strict=True)
            )
        sample.detokenizer = IncrementalDetokenizer(
            self.tokenizer, parent.prompt_token_ids, parent.params.skip_special_tokens
        )
        sample.full_text = sample.detokenizer.add_tokens(out.token_ids)
        stop = parent.params.stop
        held = stop_holdback(sample.full_text, stop) if stop else 0
        out.text = sample.full_text[: len(sample.full_text) - held]
        sample.sent_tokens = min(sample.sent_tokens, num_tokens)
        sample.sent_text = min(sample.sent_text, len(out.text))

    def _fail(self, parent: _Parent, sample: _Sample, error: str) -> list[str]:
        """End a request because one of its samples failed: that sample finishes with "error",
        the others with "abort". Returns the ids of the samples for the core to stop."""
        if parent.error is None:
            parent.error = error
        sample.output.finish_reason = "error"
        for other in parent.samples:
            if not other.output.finished:
                other.output.finish_reason = "abort"
        return [_child_id(parent.request_id, s.output.index) for s in parent.samples]

    def _record_prompt_logprobs(
        self, parent: _Parent, first_position: int, entries: list[TokenLogprobs]
    ) -> None:
        table = parent.prompt_logprobs
        if table is None:
            return
        for position, logprobs in enumerate(entries, start=first_position):
            if table[position] is None:
                table[position] = self._logprob_entry(parent.prompt_token_ids[position], logprobs)
                parent.num_prompt_logprobs += 1

    def _logprob_entry(self, token_id: int, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The token with its rank, then the top-k with ranks 1..k (the token may be among them)."""
        chosen_lp, rank, top = logprobs
        entry = {token_id: Logprob(chosen_lp, rank, self._decode_one(token_id))}
        for rank_k, (tid, lp) in enumerate(top, start=1):
            entry.setdefault(tid, Logprob(lp, rank_k, self._decode_one(tid)))
        return entry

    def _release(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for k in range(len(parent.samples)):
            self._samples.pop(_child_id(parent.request_id, k), None)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _child_id(request_id: str, index: int) -> str:
    return f"{index}:{request_id}"
