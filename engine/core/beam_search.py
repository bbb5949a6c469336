"""Beam search in the engine core, on shared blocks.

A request with `SamplingParams.use_beam_search` arrives as its n samples (the beam width k);
the core runs one `BeamSearch` for them. Each beam is a scheduler request that computes one
token per round: it asks for the top 2k logprobs of the model (the runner's logprobs: log
softmax of the raw logits) and pauses after its token (`Request.pause_after_sample`) so the
next round waits for the search's choice. A round then:

1. ranks every beam's 2k continuations by cumulative logprob and keeps the best 2k;
2. of those, the ones among the best k that end in EOS (or reach max_tokens: the last round)
   become finished hypotheses, scored cumulative logprob / (generated length ** length_penalty);
   the finished set keeps the k best scores;
3. the best k that go on are the next beams: a beam continued by the token the runner already
   appended (its argmax) stays as it is; any other continuation forks its beam's blocks
   (`Scheduler.fork_request`: ref counts up, the shared last block copied when first written),
   and beams nobody continues end, freeing their blocks.

It ends after max_tokens, when no beam goes on, or when no running beam can still beat the
worst of k finished hypotheses (an exact bound). These are the rules of transformers'
`generate(num_beams=k, early_stopping="never")`; its default early stopping is a heuristic that
may end sooner once hypotheses have finished. The k best hypotheses come back as the request's
samples, best first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedserve.engine.messages import CoreRequest, SampleOutput
from pagedserve.scheduler import LoRARequest, Request, RequestStatus, SamplingParams, Scheduler


@dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters, as vLLM names them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def sampling_params(self) -> SamplingParams:
        """The same search as SamplingParams (what the engine and the server take)."""
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            use_beam_search=True,
            temperature=0.0,
        )


def beam_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """How finished beams are ranked: cumulative logprob / length ** length_penalty, `length`
    counting the generated tokens (EOS included), as transformers does (vLLM counts the prompt
    too)."""
    return cumulative_logprob / (length**length_penalty)


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (ended in EOS) | "length"


@dataclass
class BeamSearch:
    """The state of one beam search: its live beams (scheduler request ids), what each
    reported this round, and the finished hypotheses."""

    sample_ids: list[str]  # where the k results go, best first
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's (width = len(sample_ids))
    arrival_time: float
    eos_token_ids: frozenset[int]
    new_id: Callable[[], str]
    lora: LoRARequest | None = None  # the request's adapter: every beam runs with it
    # Live beam id -> (generated tokens, cumulative logprob), before this round's token.
    beams: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    # This round: beam id -> (the top 2k (token, logprob), the beam ended in the scheduler).
    reported: dict[str, tuple[list[tuple[int, float]], bool]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0  # tokens each live beam has

    @property
    def width(self) -> int:
        return len(self.sample_ids)

    def beam_params(self) -> SamplingParams:
        """A beam's own params: greedy (the runner appends its argmax, the most common
        choice), the top 2k logprobs, and no stop rule but the length (EOS is the search's)."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.params.max_tokens,
            ignore_eos=True,
            logprobs=2 * self.width,
            skip_special_tokens=self.params.skip_special_tokens,
        )

    def new_beam(self, token_ids: list[int], cumulative_logprob: float) -> Request:
        request = Request(
            self.new_id(),
            self.prompt_token_ids,
            self.beam_params(),
            self.eos_token_ids,
            self.arrival_time,
            lora=self.lora,
        )
        request.append_output_token_ids(token_ids)
        request.pause_after_sample = True
        self.beams[request.request_id] = (token_ids, cumulative_logprob)
        return request

    def report(self, out: SampleOutput) -> None:
        """A beam's token of this round, with its top logprobs."""
        assert out.logprobs is not None, f"beam {out.request_id} came back without logprobs"
        self.reported[out.request_id] = (out.logprobs[2], out.finish_reason is not None)

    @property
    def round_done(self) -> bool:
        return len(self.reported) == len(self.beams)

    def advance(self, scheduler: Scheduler) -> list[SampleOutput]:
        """Run the round's choice on the scheduler's requests; returns the results when the
        search is over (every beam then ended), else nothing."""
        k, params = self.width, self.params
        length = self.num_generated + 1
        last = length >= params.max_tokens or any(ended for _, ended in self.reported.values())
        candidates = sorted(
            (
                (cum + logprob, beam_id, token)
                for beam_id, (tokens, cum) in self.beams.items()
                for token, logprob in self.reported[beam_id][0]
            ),
            key=lambda c: -c[0],
        )[: 2 * k]
        going_on = []
        for rank, (cum, beam_id, token) in enumerate(candidates):
            eos = token in self.eos_token_ids and not params.ignore_eos
            if last or eos:
                if rank < k:  # only the best k may finish, the others are spares
                    tokens = [*self.beams[beam_id][0], token]
                    score = beam_score(cum, length, params.length_penalty)
                    self.finished.append(
                        Hypothesis(tokens, cum, score, "stop" if eos else "length")
                    )
            elif len(going_on) < k:
                going_on.append((cum, beam_id, token))
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:k]
        self.reported = {}
        if last or not going_on or not self._can_improve(going_on[0][0], length):
            self._end(scheduler, self.beams)
            return self.results()
        self._next_beams(scheduler, going_on)
        self.num_generated = length
        return []

    def _can_improve(self, best_cumulative: float, length: int) -> bool:
        """Whether a running beam may still beat the worst of k finished hypotheses. Logprobs
        are <= 0, so a beam's cumulative logprob only falls; its best possible score divides
        it by the longest length it may reach when length_penalty > 0, else by its length now."""
        if len(self.finished) < self.width:
            return True
        penalty = self.params.length_penalty
        best_length = self.params.max_tokens if penalty > 0 else length
        best = beam_score(best_cumulative, best_length, penalty)
        return best > self.finished[-1].score

    def _next_beams(self, scheduler: Scheduler, going_on: list[tuple[float, str, int]]) -> None:
        old, self.beams = self.beams, {}
        kept = set()
        for cum, beam_id, token in going_on:
            beam = scheduler.requests[beam_id]
            if beam_id not in kept and beam.output_token_ids[-1] == token:
                kept.add(beam_id)  # the runner appended this very token: the beam goes on
                beam.awaiting_choice = False
                self.beams[beam_id] = ([*old[beam_id][0], token], cum)
            else:
                child = self.new_beam([*old[beam_id][0], token], cum)
                scheduler.fork_request(beam, child)
        self._end(scheduler, (beam_id for beam_id in old if beam_id not in kept))

    @staticmethod
    def _end(scheduler: Scheduler, beam_ids: Iterable[str]) -> None:
        for beam_id in list(beam_ids):
            scheduler.finish_request(beam_id, RequestStatus.FINISHED_ABORTED)

    def results(self) -> list[SampleOutput]:
        """The k best hypotheses, best first. Fewer than k finished only when every
        continuation of a round ended (several EOS ids): the samples left over end empty."""
        outputs = [
            SampleOutput(
                sample_id,
                hypothesis.token_ids,
                hypothesis.finish_reason,
                cumulative_logprob=hypothesis.cumulative_logprob,
            )
            for sample_id, hypothesis in zip(self.sample_ids, self.finished, strict=False)
        ]
        outputs += [SampleOutput(sid, [], "stop") for sid in self.sample_ids[len(outputs) :]]
        return outputs

    def abort(self, scheduler: Scheduler) -> None:
        self._end(scheduler, self.beams)
        self.beams = {}


def start_beam_search(
    samples: list[CoreRequest], eos_token_ids: Iterable[int], new_id: Callable[[], str]
) -> tuple[BeamSearch, Request]:
    """A search for a request's samples and its first beam (the prompt), to add to the
    scheduler."""
    first = samples[0]
    search = BeamSearch(
        sample_ids=[sample.request_id for sample in samples],
        prompt_token_ids=first.prompt_token_ids,
        params=first.params,
        arrival_time=first.arrival_time,
        eos_token_ids=frozenset(eos_token_ids),
        new_id=new_id,
        lora=first.lora,
    )
    return search, search.new_beam([], 0.0)


class BeamSearches:
    """The core's live beam searches, by the ids of their beams and of their result samples."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: Iterable[int]) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self._of_beam: dict[str, BeamSearch] = {}
        self._of_sample: dict[str, BeamSearch] = {}
        beam_ids = itertools.count()
        self._new_beam_id = lambda: f"beam-{next(beam_ids)}"

    def __bool__(self) -> bool:
        return bool(self._of_beam)

    def start(self, samples: list[CoreRequest]) -> None:
        """Start the search whose results `samples` are: its first beam goes to the scheduler."""
        search, first = start_beam_search(samples, self.eos_token_ids, self._new_beam_id)
        self.scheduler.add_request(first)
        self._of_beam[first.request_id] = search
        for sample in samples:
            self._of_sample[sample.request_id] = search

    def abort(self, sample_id: str) -> bool:
        """End the search `sample_id` is a result of; False when it is not one."""
        search = self._of_sample.get(sample_id)
        if search is not None:
            self._drop(search)
        return search is not None

    def route(self, outputs: list[SampleOutput]) -> list[SampleOutput]:
        """Beams' outputs go to their searches, which move on once every beam of theirs has its
        token; what comes out is a finished search's results (or a failed one's error), beside
        the outputs of other samples."""
        routed: list[SampleOutput] = []
        touched: dict[int, BeamSearch] = {}
        for out in outputs:
            search = self._of_beam.get(out.request_id)
            if search is None:
                routed.append(out)
            elif out.finish_reason == "error":  # the beam's step failed: so does the search
                routed.append(SampleOutput(search.sample_ids[0], [], "error", error=out.error))
                self._drop(search)
            elif out.new_token_ids:
                search.report(out)
                touched[id(search)] = search
        for search in touched.values():
            if search.sample_ids[0] not in self._of_sample or not search.round_done:
                continue  # dropped above, or still waiting for a beam
            before = list(search.beams)
            results = search.advance(self.scheduler)
            for beam_id in before:
                del self._of_beam[beam_id]
            if results:
                self._drop(search)
                routed += results
            else:
                self._of_beam.update(dict.fromkeys(search.beams, search))
        return routed

    def _drop(self, search: BeamSearch) -> None:
        """End a beam search: its beams' blocks are freed, its ids forgotten."""
        search.abort(self.scheduler)
        for beam_id in [b for b, s in self._of_beam.items() if s is search]:
            del self._of_beam[beam_id]
        for sample_id in search.sample_ids:
            self._of_sample.pop(sample_id, None)
