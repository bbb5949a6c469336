"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedserve.scheduler.block_pool import Block
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
from pagedserve.scheduler.step_plan import StepPlan, prefill_cap

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
    prefill or decode path. A step (vLLM v1 style) has three phases, each a method saying what
    it decides: the running requests get their tokens first, preempting the latest admitted
    when the pool runs out (`_schedule_running`); only if nothing was preempted, waiting
    requests are admitted in FIFO order, with no overtaking (`_schedule_waiting`); then the
    output is built (`_step_output`).

    `num_computed_tokens` advances at schedule() time: the runner computes those tokens in
    this step. update_from_output() then appends sampled tokens and applies stop rules.
    schedule() may run again before update_from_output() (asynchronous scheduling): a token
    being sampled counts as a placeholder (`Request.num_output_placeholders`) whose position
    is scheduled like any other; the runner fills its id in on the device.

    Its parts in files of their own: preemption and swap (scheduler/preemption.py), speculative
    drafts (scheduler/speculation.py), forks and rewind (scheduler/forks.py), the step being
    decided (scheduler/step_plan.py), and the block map it serves (scheduler/kv_map.py).
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
        config = self.config
        plan = StepPlan(
            config.max_num_batched_tokens,
            prefill_cap(config, self.running, len(self.waiting)),
        )
        self._schedule_running(plan)
        # Admitting while preempting would hand the blocks just freed to newer requests.
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._step_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests, oldest first, each get min(tokens left, budget left), prompt
        chunks within the step's prefill cap, and a decode step drafts where prompt lookup finds
        some. One the pool cannot serve preempts others, or itself (`_preempt_until_fits`).
        Skipped: requests awaiting a choice, and those whose token in flight is their last."""
        kv = self.kv_cache_manager
        running = self.running
        max_model_len = self.config.max_model_len
        spec_k = self.config.num_speculative_tokens
        token_budget, prefill_left = plan.token_budget, plan.prefill_left
        cached_ids, cached_new_blocks = plan.cached_ids, plan.cached_new_blocks
        cached_starts = plan.cached_starts
        index = 0
        # The hot loop of a decode step (one pass per running request): attribute reads are
        # inlined rather than going through Request's properties, and the plan's budgets and
        # lists are locals.
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
                new_block_ids = kv.allocate_slots(request, num_new_tokens)
                if new_block_ids is None:
                    new_block_ids = self._preempt_until_fits(request, num_new_tokens, plan)
                    if new_block_ids is None:
                        continue  # it preempted itself
            if request.send_in_full:  # forked, or rewound: the runner has no row for it
                request.send_in_full = False
                plan.add_new(request, kv)
            else:
                cached_ids.append(request.request_id)
                cached_new_blocks.append(tuple(new_block_ids) if new_block_ids else ())
                cached_starts.append(request.num_computed_tokens)
            plan.advance(request, num_new_tokens)
            if drafts:
                # The drafts are computed too; update_from_output takes back the rejected ones.
                request.spec_token_ids = plan.spec_tokens[request.request_id] = drafts
                request.num_computed_tokens += len(drafts)
                num_new_tokens += len(drafts)
                plan.num_scheduled[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            index += 1
        plan.token_budget, plan.prefill_left = token_budget, prefill_left

    def _preempt_until_fits(
        self, request: Request, num_new_tokens: int, plan: StepPlan
    ) -> list[int] | None:
        """The pool cannot give a running request its slots: preempt the latest-admitted running
        request (`_preempt`, swapping it out where the host pool has room) and retry until they
        fit; returns the new block ids, None when the request had to preempt itself. Victims
        come from the tail of `running`, which lies after the request: requests already
        scheduled this step are never preempted."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, swap=True)
            plan.preempted.append(victim)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order while a sequence slot and budget remain: a
        swapped one comes back from the host pool (`_swap_in`), any other starts after its
        prefix-cache hit. Left in place for the ones behind: requests awaiting a choice or their
        grammar, and those of an adapter with no free slot. Admission stops at the first request
        that does not fit (no overtaking), unless preempting a request that awaits a choice
        makes room."""
        kv = self.kv_cache_manager
        config = self.config
        position = 0  # requests before it in the queue are skipped
        loras = self._running_loras() if config.max_loras else set()
        num_encoded = 0
        while (
            position < len(self.waiting)
            and plan.token_budget > 0
            and len(self.running) < config.max_num_seqs
        ):
            request = self.waiting[position]
            if request.awaiting_choice or request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                position += 1
                continue
            lora = request.lora.lora_int_id if request.lora else 0
            if lora and lora not in loras and len(loras) >= config.max_loras:
                # Every adapter slot is held by running requests: it waits for one, and
                # the requests behind it (other adapters, the base model) go first.
                position += 1
                continue
            if request.num_output_placeholders:
                # Preempted while its last token was being sampled: it resumes once that
                # token is back (the next update_from_output), with all its tokens known.
                break
            if kv.is_swapped(request.request_id):
                if self._swap_in(request, plan):
                    plan.token_budget -= plan.num_scheduled[request.request_id]
                    if lora:
                        loras.add(lora)
                    continue
                if kv.is_swapped(request.request_id):
                    if self._preempt_idle(plan.preempted):
                        continue
                    break  # FIFO: it waits for room, and so does everyone behind it
                # Its KV was dropped (it could never fit back): admitted to recompute.
            encode = request.encoder_input is not None
            if encode and num_encoded and plan.token_budget < config.encoder_tokens:
                break  # the step's encoder work is spent: it starts next step
            chunk = self._first_chunk(request, plan)
            if chunk is None:
                break  # it starts in a later step
            computed_blocks, num_cached_tokens, num_new_tokens = chunk
            if (
                encode and not kv.allocate_encoder_blocks(request, config.encoder_blocks)
            ) or kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                if encode:
                    kv.free(request)  # its encoder blocks, when only its slots found no room
                if self._preempt_idle(plan.preempted):
                    continue  # room from a request awaiting a choice; try again
                break  # FIFO: nobody overtakes the head of the queue
            del self.waiting[position]
            if lora:
                loras.add(lora)
            self._start(request, num_cached_tokens, num_new_tokens, plan)
            num_encoded += encode

    def _first_chunk(
        self, request: Request, plan: StepPlan
    ) -> tuple[list[Block | None], int, int] | None:
        """A request's prefix-cache hit and the tokens of its first chunk, as (cached blocks,
        cached tokens, new tokens); None when it must wait for a later step: the decoding
        streams took the step's prefill cap, or its prompt must run whole and does not fit."""
        if request.sampling_params.prompt_logprobs is None:
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
        else:
            # Prompt logprobs need the logits of every prompt position, but cached tokens
            # skip the forward pass: such a request never reads the prefix cache (as in
            # vLLM v1). Its own full blocks are still cached for later requests.
            computed_blocks, num_cached_tokens = [], 0
        num_new_tokens = min(request.num_tokens - num_cached_tokens, plan.token_budget)
        if plan.prefill_left is not None:
            if plan.prefill_left == 0:
                return None
            num_new_tokens = min(num_new_tokens, plan.prefill_left)
        if self.config.prefill_only and num_new_tokens < request.num_tokens:
            return None
        return computed_blocks, num_cached_tokens, num_new_tokens

    def _start(self, request: Request, num_cached: int, num_new: int, plan: StepPlan) -> None:
        """Run a request taken off the queue with its slots granted: it is sent in full, and its
        first chunk (and its encoder pass, for at most the budget left) charged to the step."""
        encode = request.encoder_input is not None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        self.running.append(request)
        plan.add_new(request, self.kv_cache_manager, encode)
        plan.advance(request, num_new)
        plan.token_budget -= num_new
        if plan.prefill_left is not None:
            plan.prefill_left -= num_new
        if encode:
            charge = min(plan.token_budget, self.config.encoder_tokens)
            plan.token_budget -= charge
            plan.encoder_charge += charge

    def _step_output(self, plan: StepPlan) -> SchedulerOutput:
        """Close the step: number it, keep whom it samples for, and hand the runner what was
        granted along with what changed since the last step (finished, preempted and rewound
        requests, copy-on-write and swap copies)."""
        self._step_id += 1
        if plan.sampling:
            self._sampling[self._step_id] = plan.sampling
        finished_ids = tuple(self._finished_since_schedule)
        self._finished_since_schedule.clear()
        preempted_ids = (*self._preempted_since_schedule, *(r.request_id for r in plan.preempted))
        self._preempted_since_schedule.clear()
        swap_out, swap_in = tuple(self._swap_out_copies), tuple(self._swap_in_copies)
        self._swap_out_copies.clear()
        self._swap_in_copies.clear()
        return plan.output(
            self._step_id,
            self.config.max_num_batched_tokens,
            preempted_ids,
            finished_ids,
            tuple(self.kv_cache_manager.take_block_copies()),
            swap_out,
            swap_in,
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
            deltas.append(RequestDelta.of(request, (token_id,)))
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
        return RequestDelta.of(request, ())

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
