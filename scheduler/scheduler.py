"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.forks import Forks
from pagedserve.scheduler.kv_map import kv_map
from pagedserve.scheduler.outputs import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    SchedulerOutput,
)
from pagedserve.scheduler.preemption import Preemption
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.speculation import Speculation

__all__ = [
    "CachedRequestData",
    "NewRequestData",
    "RequestDelta",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]


class Scheduler(Preemption, Speculation, Forks):
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

    Its parts in files of their own: preemption and swap (scheduler/preemption.py), speculative
    drafts (scheduler/speculation.py), forks and rewind (scheduler/forks.py), and the block map
    it serves (scheduler/kv_map.py).
    """

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

    def only_grammars_awaited(self) -> bool:
        """True when every live request waits for its grammar: no step can do anything."""
        waiting = RequestStatus.WAITING_FOR_GRAMMAR
        return all(request.status == waiting for request in self.requests.values())

    def grammar_ready(self, request_id: str) -> None:
        """The request's grammar has compiled: it may be admitted (in its place in the queue,
        or, attached to a parent sample, when the parent forks it)."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            request.status = RequestStatus.WAITING

    def kv_map(self) -> dict:
        """The live block map (GET /v1/kv): scheduler/kv_map.py."""
        return kv_map(self)

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
        new = request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)
        assert new and not request.num_computed_tokens, (
            f"request {request_id!r} is not new ({request.status.name})"
        )
        # A prompt of max_model_len tokens or more leaves no room for an output token (an
        # embedding's, prefill_only, needs none).
        limit = self.config.max_model_len + self.config.prefill_only
        assert 0 < request.num_prompt_tokens < limit, (
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
        num_encoded = encoder_charge = 0
        if not preempted:
            position = 0  # requests before it in the queue await a choice (beams): skipped
            loras = self._running_loras() if self.config.max_loras else set()
            while (
                position < len(self.waiting)
                and token_budget > 0
                and len(self.running) < self.config.max_num_seqs
            ):
                request = self.waiting[position]
                if request.awaiting_choice or request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                    position += 1
                    continue
                lora = request.lora.lora_int_id if request.lora else 0
                if lora and lora not in loras and len(loras) >= self.config.max_loras:
                    # Every adapter slot is held by running requests: it waits for one, and
                    # the requests behind it (other adapters, the base model) go first.
                    position += 1
                    continue
                if request.num_output_placeholders:
                    # Preempted while its last token was being sampled: it resumes once that
                    # token is back (the next update_from_output), with all its tokens known.
                    break
                if kv.is_swapped(request.request_id):
                    if self._swap_in(request, token_budget, new_requests, num_scheduled, sampling):
                        token_budget -= num_scheduled[request.request_id]
                        if lora:
                            loras.add(lora)
                        continue
                    if kv.is_swapped(request.request_id):
                        if self._preempt_idle(preempted):
                            continue
                        break  # FIFO: it waits for room, and so does everyone behind it
                    # Its KV was dropped (it could never fit back): admitted to recompute.
                encode = request.encoder_input is not None
                if encode and num_encoded and token_budget < self.config.encoder_tokens:
                    break  # the step's encoder work is spent: it starts next step
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
                if self.config.prefill_only and num_new_tokens < request.num_tokens:
                    break  # its prompt runs whole, in a step with room for it
                encoder_blocks = self.config.encoder_blocks
                if (
                    encode and not kv.allocate_encoder_blocks(request, encoder_blocks)
                ) or kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                    if encode:
                        kv.free(request)  # its encoder blocks, when only its slots found no room
                    if self._preempt_idle(preempted):
                        continue  # room from a request awaiting a choice; try again
                    break  # FIFO: nobody overtakes the head of the queue
                del self.waiting[position]
                if lora:
                    loras.add(lora)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached_tokens
                self.running.append(request)
                new_requests.append(self._new_request_data(request, encode))
                self._advance(request, num_new_tokens, num_scheduled, sampling)
                token_budget -= num_new_tokens
                if prefill_left is not None:
                    prefill_left -= num_new_tokens
                if encode:
                    num_encoded += 1
                    charge = min(token_budget, self.config.encoder_tokens)
                    token_budget -= charge
                    encoder_charge += charge

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
            total_num_scheduled_tokens=(
                self.config.max_num_batched_tokens - token_budget - encoder_charge
            ),
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            spec_token_ids=spec_tokens,
            block_copies=tuple(self.kv_cache_manager.take_block_copies()),
            swap_out=swap_out,
            swap_in=swap_in,
        )

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters (names, sorted) of the running requests and of those not running."""
        running_ids = set(map(id, self.running))
        running = {r.lora.lora_name for r in self.running if r.lora}
        waiting = {
            r.lora.lora_name for r in self.requests.values() if r.lora and id(r) not in running_ids
        }
        return tuple(sorted(running)), tuple(sorted(waiting))

    def _running_loras(self) -> set[int]:
        """The adapters of the running requests: each holds a device slot this step."""
        return {request.lora.lora_int_id for request in self.running if request.lora}

    def _new_request_data(self, request: Request, encode: bool = False) -> NewRequestData:
        """The request in full, for a runner that has no state for it (before `_advance`);
        `encode`: its encoder blocks are new, for the runner to fill from its encoder input."""
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            block_ids=tuple(self.kv_cache_manager.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
            encoder_block_ids=tuple(self.kv_cache_manager.encoder_block_ids(request.request_id)),
            encoder_input=request.encoder_input if encode else None,
            lora=request.lora,
        )

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
            # (min_tokens: the sampler never samples a finishing token before; vLLM's check.)
            if (
                token_id in request.finishing_token_ids
                and len(output_token_ids) > request.sampling_params.min_tokens
            ):
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
