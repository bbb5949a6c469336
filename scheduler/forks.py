"""Requests that share blocks with another (beams continued by another token, n > 1 samples of
one prompt) and requests that take tokens back (rewind): the scheduler's part of both."""

from __future__ import annotations

from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.state import SchedulerState


class Forks(SchedulerState):
    """Forking and rewinding requests (a part of `Scheduler`)."""

    def fork_request(self, parent: Request, child: Request) -> None:
        """Add `child`, whose tokens are the parent's up to its computed ones and then its own
        (a beam continued by another token than the one the parent sampled). A running parent's
        blocks of its computed tokens are shared (`KVCacheManager.fork`) and the child runs at
        once, to be sent to the runner in full; a parent without blocks (preempted) shares
        nothing and the child queues first, to compute its tokens alone."""
        request_id = child.request_id
        assert request_id not in self.requests, f"request id {request_id!r} is already in use"
        num_shared = parent.num_computed_tokens
        assert child.all_token_ids[:num_shared] == parent.all_token_ids[:num_shared], (
            f"request {request_id!r} does not continue {parent.request_id!r}'s computed tokens"
        )
        self.requests[request_id] = child
        if parent.status == RequestStatus.RUNNING and num_shared:
            self._run_forked(parent, child, num_shared)
        else:
            self.waiting.appendleft(child)

    def _run_forked(self, parent: Request, child: Request, num_shared: int) -> None:
        """The child shares the parent's blocks of its first `num_shared` tokens, has computed
        them, and runs; the runner gets it in full at the next schedule()."""
        self.kv_cache_manager.fork(parent, child, num_shared)
        child.num_computed_tokens = num_shared
        child.status = RequestStatus.RUNNING
        child.send_in_full = True
        self.running.append(child)

    def rewind(self, request_id: str, num_tokens: int) -> int:
        """Take back the last `num_tokens` output tokens of a live request, running or waiting,
        and return how many output tokens it has left.

        A running request's blocks past the new end go back to the pool
        (`KVCacheManager.truncate`); the kept prefix stays in the cache and is not computed
        again, except the last kept token, whose logits give the next one (unless a sliding
        window already gave back blocks the new end needs: then it is all computed again). The
        runner gets the shortened request in full at its next step; a token it still has in
        flight is dropped when it comes back. A waiting request holds no device blocks: only its
        tokens go back (a swapped one drops its host copy and recomputes).
        """
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"cannot rewind request {request_id!r}: it is unknown or finished")
        num_outputs = len(request.output_token_ids)
        if not 0 < num_tokens <= num_outputs:
            raise ValueError(
                f"cannot rewind request {request_id!r} by {num_tokens} tokens: it has "
                f"{num_outputs} output tokens (rewind by 1 to {num_outputs})"
            )
        if request.num_output_placeholders:
            for sampling in self._sampling.values():
                if request in sampling:
                    sampling.remove(request)
            request.num_output_placeholders = 0
        request.ngram_index = None  # indexes the tokens taken back too
        del request.output_token_ids[-num_tokens:]
        del request.all_token_ids[-num_tokens:]
        if self.kv_cache_manager.drop_swapped(request):  # recomputed rather than cut
            request.num_computed_tokens = 0
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens = self.kv_cache_manager.truncate(
                request, min(request.num_computed_tokens, request.num_tokens - 1)
            )
            if not request.send_in_full:
                request.send_in_full = True
                self._preempted_since_schedule.append(request_id)  # the runner drops its row
        return len(request.output_token_ids)

    def _fork_children(self, parent: Request, share: bool) -> None:
        """Release the samples attached to `parent`. With `share` (the parent runs and its
        prompt's KV is computed), as many as there are free sequence slots fork the parent's
        blocks holding all prompt tokens but the last and join the running requests, to be sent
        to the runner in full; the rest stay attached for a later token of the parent. Without
        it they go to the head of the queue, in their order, to compute their prompts alone."""
        num_shared = parent.num_prompt_tokens - 1
        if share and num_shared:
            free_slots = max(0, self.config.max_num_seqs - len(self.running))
            num_forked = min(len(parent.fork_children), free_slots)
            for child in parent.fork_children[:num_forked]:
                child.fork_parent = None
                self._run_forked(parent, child, num_shared)
            del parent.fork_children[:num_forked]
            self._num_attached -= num_forked
            return
        children, parent.fork_children = parent.fork_children, []
        self._num_attached -= len(children)
        for child in reversed(children):
            child.fork_parent = None
            self.waiting.appendleft(child)
