"""Speculative decoding in the scheduler: drafts proposed by prompt lookup (scheduler/ngram.py)
before a decode step, and the accepted ones applied after it."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.ngram import NgramIndex
from pagedserve.scheduler.outputs import RequestDelta
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.state import SchedulerState


class Speculation(SchedulerState):
    """The Scheduler's draft proposals and their acceptance (a part of `Scheduler`)."""

    def _propose(self, request: Request, max_drafts: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request by prompt lookup, at most `max_drafts` and never
        past its max_tokens or max_model_len.

        The runner samples every verified position from the request's own distribution and the
        drafts are accepted while they equal what it sampled; for a draft that is a single
        token (not a distribution) that is exactly rejection sampling: a draft d is kept with
        probability p(d), and a rejected one is replaced by a draw from p without d. So greedy
        and sampled requests keep their outputs' distribution, and a seeded request, whose k-th
        token always uses the k-th number of its seed, its very tokens. Requests with logprobs
        or penalties get no drafts: an output carries one token's logprobs, and penalties read
        a history the drafts would have to be part of.
        """
        index = request.ngram_index
        if index is None:
            params = request.sampling_params
            drafts = params.logprobs is None and not any(params.needs_history)
            index = request.ngram_index = (
                NgramIndex(self.config.ngram_min, self.config.ngram_max) if drafts else False
            )
        if index is False:
            return ()
        num_tokens = len(request.all_token_ids)
        room = min(
            request.sampling_params.max_tokens - len(request.output_token_ids),
            self.config.max_model_len - num_tokens,
        )
        max_drafts = min(max_drafts, room - 1)  # the step's own sampled token comes on top
        if max_drafts < 1:
            return ()
        return tuple(index.propose(request.all_token_ids, max_drafts))

    def _apply_accepted(self, request: Request, tokens: Sequence[int]) -> RequestDelta:
        """Append a speculative step's tokens (the accepted drafts, then the model's own next
        token) one by one under the stop rules; the rejected drafts' positions are computed
        again. Returns the request's delta."""
        drafts = request.spec_token_ids
        request.spec_token_ids = ()
        num_accepted = len(tokens) - 1
        if not 0 <= num_accepted <= len(drafts) or list(tokens[:-1]) != list(drafts[:num_accepted]):
            raise ValueError(
                f"request {request.request_id!r}: accepted tokens {list(tokens)} do not start "
                f"with a prefix of its drafts {list(drafts)}"
            )
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        request.num_computed_tokens -= len(drafts) - num_accepted
        params = request.sampling_params
        finished = None
        appended = 0
        for token_id in tokens:
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            appended += 1
            if (
                token_id in request.finishing_token_ids
                and len(request.output_token_ids) > params.min_tokens
            ):
                finished = RequestStatus.FINISHED_STOPPED
            elif (
                len(request.output_token_ids) >= params.max_tokens
                or len(request.all_token_ids) >= self.config.max_model_len
            ):
                finished = RequestStatus.FINISHED_LENGTH
            if finished is not None:
                break
        new_token_ids = tuple(tokens[:appended])
        if finished is None:
            return RequestDelta.of(request, new_token_ids)
        self._release(request, finished, remove_from_queues=request.status != RequestStatus.RUNNING)
        return RequestDelta.of(request, new_token_ids)
