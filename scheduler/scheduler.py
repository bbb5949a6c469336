"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from pagedserve.scheduler.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.ngram import NgramIndex
from pagedserve.scheduler.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    SchedulerOutput,
)
from pagedserve.scheduler.request import Request, RequestStatus

__all__ = [
    "CachedRequestData",
    "NewRequestData",
    "RequestDelta",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes.

    Every request catches its `num_computed_tokens` up to `num_tokens`; there is no separate
    prefill or decode path. One step (vLLM v1 style):

    1. Running requests, oldest first, each get min(tokens left, token budget left). When
       the pool cannot give one of them slots, the latest-admitted running request is
       preempted (blocks freed, progress reset, put at the front of the waiting queue) and
       the allocation retried; a request may end up preempting itself. In swap mode (a host
       pool, `SchedulerConfig.num_host_blocks`) the victim's blocks move to the host pool
       instead when it has room, and the victim keeps its progress.
    2. Only if nothing was preempted, waiting requests are admitted in FIFO order while a
       sequence slot and budget remain, reusing prefix-cache hits (a swapped request's blocks
       come back from the host pool); admission stops at the first request that does not fit
       (no overtaking).

    `num_computed_tokens` advances at schedule() time: the runner computes those tokens in
    this step. update_from_output() then appends sampled tokens and applies stop rules.
    schedule() may run again before update_from_output() (asynchronous scheduling): a token
    being sampled counts as a placeholder (`Request.num_output_placeholders`) whose position
    is scheduled like any other; the runner fills its id in on the device.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.kv_group_windows,
            config.num_host_blocks,
        )
        # Live requests only (waiting, running, preempted); finished ones leave at once.
        self.requests: dict[str, Request] = {}
        # Preempted requests sit at the front, so they resume before newer arrivals.
        self.waiting: deque[Request] = deque()
        # Admission order: the tail is the first to be preempted.
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Swap preemption: preemptions that moved the request's KV to the host pool (the rest
        # recomputed), resumptions that moved it back, and this step's copies for the runner.
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self._swap_out_copies: list[tuple[int, int]] = []
        self._swap_in_copies: list[tuple[int, int]] = []
        # Speculative decoding: drafts scheduled, and accepted, in the steps applied so far.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Samples attached to a parent sample (add_request's fork_parent), in no queue yet.
        self._num_attached = 0
        self._finished_since_schedule: list[str] = []
        # Taken out of the batch by undo_step or rewind, for the runner to drop.
        self._preempted_since_schedule: list[str] = []
        # Per step not yet applied by update_from_output: the requests it samples for.
        self._step_id = 0
        self._sampling: dict[int, list[Request]] = {}

    # --------------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, preempted ones and attached samples included."""
        return len(self.waiting) + self._num_attached

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or preempted."""
        return bool(self.requests)

    def kv_map(self) -> dict:
        """The live block map (GET /v1/kv): every block's state, ref count, owners and prefix
        hash, every live request's blocks, and the pool's totals. Plain JSON-ready data;
        O(blocks + table entries), a few milliseconds for tens of thousands of blocks."""
        kv = self.kv_cache_manager
        states, refs, cached = kv.block_pool.block_states()
        owners = kv.block_owners()
        size = kv.block_size
        running = set(map(id, self.running))
        requests = []
        num_unused = 0
        for request in self.requests.values():
            if id(request) in running:
                status = "running"
            elif kv.is_swapped(request.request_id):
                status = "swapped"
            elif request.status == RequestStatus.PREEMPTED:
                status = "preempted"
            else:
                status = "waiting"
            unused = kv.num_unused_slots(request)
            num_unused += unused
            requests.append(
                {
                    "id": request.request_id,
                    "status": status,
                    "num_prompt_tokens": request.num_prompt_tokens,
                    "num_output_tokens": request.num_output_tokens,
                    "num_computed_tokens": request.num_computed_tokens,
                    # null: a sliding-window block given back
                    "block_ids": kv.table_entries(request.request_id),
                    "num_swapped_blocks": kv.swapped_block_count(request.request_id),
                    "num_unused_slots": unused,
                    "num_preemptions": request.num_preemptions,
                }
            )
        num_used = sum(state == BLOCK_USED for state in states)
        queries, hits = kv.num_prefix_cache_queries_tokens, kv.num_prefix_cache_hits_tokens
        host = kv.host_pool
        return {
            "block_size": size,
            "num_blocks": kv.num_total_blocks,
            "num_groups": kv.num_groups,
            "blocks": {"state": states, "ref_count": refs, "cached": cached},
            # JSON object keys are strings: block id -> request ids holding it.
            "owners": {str(block_id): ids for block_id, ids in owners.items()},
            "requests": requests,
            "totals": {
                "used_blocks": num_used,
                "free_blocks": states.count(BLOCK_FREE),
                "cached_free_blocks": states.count(BLOCK_CACHED),
                "cached_blocks": kv.block_pool.num_cached_blocks,
                "shared_blocks": sum(ref > 1 for ref in refs),
                "usage": num_used / kv.num_total_blocks,
                "prefix_cache_queries": queries,
                "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "host_blocks": 0 if host is None else host.num_blocks,
                "swapped_blocks": kv.num_swapped_blocks,
                "fragmentation_tokens": num_unused,
                "fragmentation": num_unused / (num_used * size) if num_used else 0.0,
                "num_running": len(self.running),
                "num_waiting": self.num_waiting,
                "num_preemptions": self.num_preemptions,
                "num_swap_outs": self.num_swap_outs,
                "num_swap_ins": self.num_swap_ins,
            },
        }

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request, fork_parent: Request | None = None) -> None:
        """Queue a new request. Its prompt was checked where it entered the engine
        (`LLMEngine.process_prompt`); here the scheduler's invariants are only asserted.

        With `fork_parent`, another sample of the same prompt added before it (n > 1), the
        request is not queued but attached to the parent. Once a token of the parent comes back
        (its prompt's KV is in the cache then) and a sequence slot is free, the request forks
        the parent's blocks holding all prompt tokens but the last (`KVCacheManager.fork`, no
        copy) and joins the running requests; it computes the last prompt token itself, for its
        own first sample. Should the parent end before that, the request is queued as it is
        and computes its prompt alone.
        """
        request_id = request.request_id
        assert request_id not in self.requests, f"request id {request_id!r} is already in use"
        assert request.status == RequestStatus.WAITING and not request.num_computed_tokens, (
            f"request {request_id!r} is not new ({request.status.name})"
        )
        # A prompt of max_model_len tokens or more leaves no room for an output token.
        assert 0 < request.num_prompt_tokens < self.config.max_model_len, (
            f"request {request_id!r} has {request.num_prompt_tokens} prompt tokens "
            f"(max_model_len {self.config.max_model_len})"
        )
        self.requests[request_id] = request
        if fork_parent is None:
            self.waiting.append(request)
            return
        assert fork_parent.request_id in self.requests and not fork_parent.output_token_ids, (
            f"fork parent {fork_parent.request_id!r} is not a live request still in its prompt"
        )
        assert fork_parent.prompt_token_ids == request.prompt_token_ids, (
            f"request {request_id!r} forks {fork_parent.request_id!r} but their prompts differ"
        )
        request.fork_parent = fork_parent
        fork_parent.fork_children.append(request)
        self._num_attached += 1

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens, allocate their KV slots and advance progress."""
        token_budget = self.config.max_num_batched_tokens
        max_model_len = self.config.max_model_len
        num_scheduled: dict[str, int] = {}
        cached_ids: list[str] = []
        cached_new_blocks: list[tuple[int, ...]] = []
        cached_starts: list[int] = []
        new_requests: list[NewRequestData] = []
        sampling: list[Request] = []
        preempted: list[Request] = []

        kv = self.kv_cache_manager
        running = self.running
        spec_k = self.config.num_speculative_tokens
        spec_tokens: dict[str, tuple[int, ...]] = {}
        # Prompt tokens this step may still take (None: only the token budget limits them).
        prefill_left = self._prefill_cap(running)
        index = 0
        # The hot loop of a decode step (one pass per running request): attribute reads are
        # inlined rather than going through Request's properties.
        while index < len(running) and token_budget > 0:
            request = running[index]
            if request.awaiting_choice:
                index += 1
                continue
            pending = request.num_output_placeholders
            target = len(request.all_token_ids) + pending
            if pending and (
                len(request.output_token_ids) + pending >= request.sampling_params.max_tokens
                or target >= max_model_len
                or request.pause_after_sample
            ):
                # The token in flight is its last (max_tokens or the context is reached): the
                # step that brings it back finishes the request, so nothing more to compute.
                # (Or the request waits for that token on purpose: a beam.)
                index += 1
                continue
            num_new_tokens = min(target - request.num_computed_tokens, token_budget)
            if prefill_left is not None and num_new_tokens > 1:  # a prefill chunk
                num_new_tokens = min(num_new_tokens, prefill_left)
                prefill_left -= num_new_tokens
            if num_new_tokens == 0:
                index += 1
                continue
            drafts: tuple[int, ...] = ()
            if spec_k and num_new_tokens == 1 and not pending and token_budget > 1:
                drafts = self._propose(request, min(spec_k, token_budget - 1))
                if drafts:
                    new_block_ids = kv.allocate_slots(request, 1 + len(drafts))
                    if new_block_ids is None:
                        drafts = ()  # no room for them: a plain decode step (which may preempt)
            if not drafts:
                while (new_block_ids := kv.allocate_slots(request, num_new_tokens)) is None:
                    # Victims come from the tail, which lies after `index`: requests already
                    # scheduled this step are never preempted.
                    victim = running.pop()
                    self._preempt(victim, swap=True)
                    preempted.append(victim)
                    if victim is request:
                        break
                if new_block_ids is None:
                    continue  # it preempted itself
            if request.send_in_full:  # forked, or rewound: the runner has no row for it
                request.send_in_full = False
                new_requests.append(self._new_request_data(request))
            else:
                cached_ids.append(request.request_id)
                cached_new_blocks.append(tuple(new_block_ids) if new_block_ids else ())
                cached_starts.append(request.num_computed_tokens)
            self._advance(request, num_new_tokens, num_scheduled, sampling)
            if drafts:
                # The drafts are computed too; update_from_output takes back the rejected ones.
                request.spec_token_ids = spec_tokens[request.request_id] = drafts
                request.num_computed_tokens += len(drafts)
                num_new_tokens += len(drafts)
                num_scheduled[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            index += 1

        # Admitting while preempting would hand the blocks just freed to newer requests.
        if not preempted:
            position = 0  # requests before it in the queue await a choice (beams): skipped
            while (
                position < len(self.waiting)
                and token_budget > 0
                and len(self.running) < self.config.max_num_seqs
            ):
                request = self.waiting[position]
                if request.awaiting_choice:
                    position += 1
                    continue
                if request.num_output_placeholders:
                    # Preempted while its last token was being sampled: it resumes once that
                    # token is back (the next update_from_output), with all its tokens known.
                    break
                if kv.is_swapped(request.request_id):
                    if self._swap_in(request, token_budget, new_requests, num_scheduled, sampling):
                        token_budget -= num_scheduled[request.request_id]
                        continue
                    if kv.is_swapped(request.request_id):
                        if self._preempt_idle(preempted):
                            continue
                        break  # FIFO: it waits for room, and so does everyone behind it
                    # Its KV was dropped (it could never fit back): admitted to recompute.
                if request.sampling_params.prompt_logprobs is None:
                    computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(
                        request
                    )
                else:
                    # Prompt logprobs need the logits of every prompt position, but cached tokens
                    # skip the forward pass: such a request never reads the prefix cache (as in
                    # vLLM v1). Its own full blocks are still cached for later requests.
                    computed_blocks, num_cached_tokens = [], 0
                num_new_tokens = min(request.num_tokens - num_cached_tokens, token_budget)
                if prefill_left is not None:
                    if prefill_left == 0:
                        break  # the streams decoding come first; it starts next step
                    num_new_tokens = min(num_new_tokens, prefill_left)
                if (
                    self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks)
                    is None
                ):
                    if self._preempt_idle(preempted):
                        continue  # room from a request awaiting a choice; try again
                    break  # FIFO: nobody overtakes the head of the queue
                del self.waiting[position]
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached_tokens
                self.running.append(request)
                new_requests.append(self._new_request_data(request))
                self._advance(request, num_new_tokens, num_scheduled, sampling)
                token_budget -= num_new_tokens
                if prefill_left is not None:
                    prefill_left -= num_new_tokens

        self._step_id += 1
        if sampling:
            self._sampling[self._step_id] = sampling
        finished_ids = tuple(self._finished_since_schedule)
        self._finished_since_schedule.clear()
        preempted_ids = (*self._preempted_since_schedule, *(r.request_id for r in preempted))
        self._preempted_since_schedule.clear()
        swap_out, swap_in = tuple(self._swap_out_copies), tuple(self._swap_in_copies)
        self._swap_out_copies.clear()
        self._swap_in_copies.clear()
        return SchedulerOutput(
            step_id=self._step_id,
            new_requests=tuple(new_requests),
            cached_requests=CachedRequestData(
                tuple(cached_ids), tuple(cached_new_blocks), tuple(cached_starts)
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - token_budget,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            spec_token_ids=spec_tokens,
            block_copies=tuple(self.kv_cache_manager.take_block_copies()),
            swap_out=swap_out,
            swap_in=swap_in,
        )

    def _new_request_data(self, request: Request) -> NewRequestData:
        """The request in full, for a runner that has no state for it (before `_advance`)."""
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            block_ids=tuple(self.kv_cache_manager.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
        )

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

    @staticmethod
    def _advance(
        request: Request,
        num_new_tokens: int,
        num_scheduled: dict[str, int],
        sampling: list[Request],
    ) -> None:
        """Record the request's share of the step and advance its progress counter; a chunk
        that reaches the end of its tokens samples the next one (a placeholder until
        update_from_output brings it)."""
        num_scheduled[request.request_id] = num_new_tokens
        request.num_computed_tokens += num_new_tokens
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            sampling.append(request)

    def _prefill_cap(self, running: list[Request]) -> int | None:
        """How many prompt tokens this step may take, when some running request decodes (one
        token to compute) and `max_prefill_tokens_while_decoding` is set; else None.

        The budget is shared per request: prompts get the waiting and prefilling requests' share
        of it, and never less than the cap. So a stream or two decoding while a burst of prompts
        arrives barely slows the burst (one stall for few streams), while many streams decoding
        as one long prompt arrives stall for at most the cap's worth of prefill per step."""
        cap = self.config.max_prefill_tokens_while_decoding
        if not cap:
            return None
        decoding = prefilling = 0
        for request in running:
            left = len(request.all_token_ids) + request.num_output_placeholders
            left -= request.num_computed_tokens
            if left == 1:
                decoding += 1
            elif left > 1:
                prefilling += 1
        if not decoding:
            return None
        wanting = prefilling + len(self.waiting)
        share = self.config.max_num_batched_tokens * wanting // (wanting + decoding)
        return max(cap, share)

    def _swap_in(
        self,
        request: Request,
        token_budget: int,
        new_requests: list[NewRequestData],
        num_scheduled: dict[str, int],
        sampling: list[Request],
    ) -> bool:
        """Resume a swapped request at the head of the queue: its KV comes back from the host
        pool into fresh device blocks, and it goes on from where it was preempted. Returns False
        when the device pool cannot take it yet. Should it never fit (nothing else runs, so no
        blocks will come free), its KV is dropped and it is recomputed like any other."""
        kv = self.kv_cache_manager
        num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
        if kv.num_swap_in_blocks(request, num_new_tokens) > kv.num_free_blocks:
            if not self.running:
                kv.drop_swapped(request)
                request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        self._swap_in_copies.extend(kv.swap_in(request))
        new_block_ids = kv.allocate_slots(request, num_new_tokens)
        assert new_block_ids is not None, f"swap-in of {request.request_id!r} found no room"
        self.num_swap_ins += 1
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        new_requests.append(self._new_request_data(request))
        self._advance(request, num_new_tokens, num_scheduled, sampling)
        return True

    def _preempt_idle(self, preempted: list[Request]) -> bool:
        """Preempt the latest-admitted running request that awaits a choice (a beam whose
        search waits for its other beams), to recompute later: it holds blocks it computes
        nothing with, and without this a pool full of such beams would admit nobody, their
        searches' other beams included. Returns False when there is none."""
        for request in reversed(self.running):
            if request.awaiting_choice:
                self.running.remove(request)
                self._preempt(request)
                preempted.append(request)
                return True
        return False

    def _preempt(self, request: Request, swap: bool = False) -> None:
        """Take a running request's blocks and requeue it first. With `swap` (a preemption
        for room, in swap mode) its KV moves to the host pool when that has room, and it
        resumes where it was; otherwise its blocks are freed and it recomputes later."""
        copies = self.kv_cache_manager.swap_out(request) if swap else None
        if copies is None:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        else:
            self._swap_out_copies.extend(copies)
            self.num_swap_outs += 1
        request.status = RequestStatus.PREEMPTED
        request.send_in_full = False  # it will be, when readmitted
        request.spec_token_ids = ()  # a step undone: its drafts never come back
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def undo_step(self, output: SchedulerOutput) -> None:
        """Forget a step that failed before it produced anything (the device ran out of memory):
        its sampling placeholders are dropped, and every request it scheduled that still runs is
        preempted, to recompute later. The prefix cache is emptied, since blocks cached when the
        step's slots were granted never received their KV."""
        for request in self._sampling.pop(output.step_id, ()):
            request.num_output_placeholders -= 1
        # In reverse: each preempted request goes to the head of the queue, so they keep their
        # order there.
        for request_id in reversed(output.num_scheduled_tokens):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._preempt(request)
            self._preempted_since_schedule.append(request_id)
        # The step's swap-out copies may not have run: no swapped KV is trusted, so every
        # swapped request recomputes.
        for request in self.waiting:
            if self.kv_cache_manager.drop_swapped(request):
                request.num_computed_tokens = 0
        self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------- results

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int],
        accepted_token_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> list[RequestDelta]:
        """Append the tokens sampled for `output`, apply stop rules, free finished requests.

        `sampled_token_ids` maps request id -> token for every request of `output` whose chunk
        sampled. Outputs are applied in the order they were scheduled, each once. Tokens of
        requests finished or aborted since schedule() are dropped; a request preempted since
        then still gets its token (it was sampled from its whole context). Returns one delta
        per request that got a token (partial prefill chunks get none), in batch order.

        A request that had drafts (`output.spec_token_ids`) gets `accepted_token_ids[id]`
        instead: the drafts the model agreed with, then its own next token.
        """
        deltas: list[RequestDelta] = []
        num_finished = 0
        max_model_len = self.config.max_model_len
        # The other hot loop of a decode step: Request's properties and the stop rules are
        # inlined (a stop token, EOS unless ignored, then the length limits, in that order).
        for request in self._sampling.pop(output.step_id, ()):
            request.num_output_placeholders -= 1
            status = request.status
            if status > RequestStatus.PREEMPTED:
                continue  # aborted or stopped since schedule(): the token has nowhere to go
            if request.spec_token_ids:
                deltas.append(self._apply_accepted(request, accepted_token_ids[request.request_id]))
                num_finished += deltas[-1].finished and status == RequestStatus.RUNNING
                continue
            try:
                token_id = sampled_token_ids[request.request_id]
            except KeyError:
                raise KeyError(
                    f"no sampled token for request {request.request_id!r}, which sampled in "
                    f"step {output.step_id}"
                ) from None
            output_token_ids = request.output_token_ids
            output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            if request.pause_after_sample:
                request.awaiting_choice = True
            if request.fork_children and status == RequestStatus.RUNNING:
                self._fork_children(request, share=True)
            if token_id in request.finishing_token_ids:
                finished = RequestStatus.FINISHED_STOPPED
            elif (
                len(output_token_ids) >= request.sampling_params.max_tokens
                or len(request.all_token_ids) >= max_model_len
            ):
                finished = RequestStatus.FINISHED_LENGTH
            else:
                deltas.append(
                    RequestDelta(
                        request.request_id,
                        (token_id,),
                        status,
                        None,
                        len(request.prompt_token_ids),
                        len(output_token_ids),
                    )
                )
                continue
            running = status == RequestStatus.RUNNING
            self._release(request, finished, remove_from_queues=not running)
            num_finished += running
            deltas.append(self._delta(request, (token_id,)))
        if num_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return deltas

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
            if token_id in request.finishing_token_ids:
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
            return self._delta(request, new_token_ids)
        self._release(request, finished, remove_from_queues=request.status != RequestStatus.RUNNING)
        return self._delta(request, new_token_ids)

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

    # ------------------------------------------------------------------- rewind

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

    # ------------------------------------------------------------- finishing early

    def finish_request(self, request_id: str, status: RequestStatus) -> RequestDelta | None:
        """End a live request now (e.g. the engine matched a stop string) and free its blocks.

        Returns its final delta (no new tokens), or None if the id is unknown or already
        finished.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._release(request, status, remove_from_queues=True)
        return self._delta(request, ())

    def fail_request(self, request_id: str) -> list[int]:
        """End a request the engine could not serve (FINISHED_ERROR), as `finish_request`, except
        that its KV is not trusted: returns the ids of the blocks it held alone, which left the
        prefix cache and which the caller clears (a NaN in a block's masked tail would still
        poison the next owner's attention)."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        block_ids = self.kv_cache_manager.free_untrusted(request)
        self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return block_ids

    def abort(self, request_id: str) -> RequestDelta | None:
        """Abort a request in any state; None if the id is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

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

    def _release(self, request: Request, status: RequestStatus, remove_from_queues: bool) -> None:
        """Mark finished, free blocks, forget the request and tell the runner next step."""
        if request.fork_children:  # ended before all of them forked: the rest go on alone
            self._fork_children(request, share=False)
        if request.fork_parent is not None:  # attached to its parent, in no queue
            request.fork_parent.fork_children.remove(request)
            request.fork_parent = None
            self._num_attached -= 1
        elif remove_from_queues:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_since_schedule.append(request.request_id)

    @staticmethod
    def _delta(request: Request, new_token_ids: tuple[int, ...]) -> RequestDelta:
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            status=request.status,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )
