"""EngineCore: the model side of the engine, one step = schedule -> run model -> update.

It knows samples (one scheduler request each) and token ids; text is the front end's
(engine/frontend/output_processor.py). Token-level stops (EOS, stop token ids, max_tokens,
max_model_len) are the scheduler's; a stop string found by the front end comes back as
`finish_samples`. `LLMEngine` runs a core in the caller's process; engine/frontend/process_client.py
runs one in its own.
"""

from __future__ import annotations

import logging
import time

import msgspec

from pagedserve.engine.core.beam_search import BeamSearches
from pagedserve.engine.core.kv_events import KVEventPublisher
from pagedserve.engine.core.scheduler_limits import scheduler_config
from pagedserve.engine.engine_config import EngineConfig, ObservabilityOptions, ParallelOptions
from pagedserve.engine.messages import CoreRequest, EngineStats, SampleOutput
from pagedserve.engine.models.bert_config import context_length, embedding_pooling
from pagedserve.engine.models.model_source import ModelSource, resolve_model
from pagedserve.engine.models.tokenizer import eos_token_ids, load_tokenizer
from pagedserve.engine.structured_output import StructuredOutputManager
from pagedserve.engine.tp_endpoint import TPEndpoint
from pagedserve.engine.worker.model_runner import (
    RunnerOutput,
    StepHandle,
)
from pagedserve.engine.worker.worker import Worker, dtype_name
from pagedserve.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from pagedserve.scheduler.kv_events import AllBlocksCleared, KVEventLog

logger = logging.getLogger("pagedserve")


class EngineCore:
    """The model side of the engine: the scheduler over a worker (the model, its KV cache and
    runner: engine/worker/worker.py). Takes samples (`add_samples`), steps them, returns what each
    step produced (`step_samples`). It runs on rank 0; with tensor parallelism the worker reaches
    the other ranks. `endpoint`: rank 0's, when the caller set the ranks up."""

    def __init__(self, config: EngineConfig, endpoint: TPEndpoint | None = None) -> None:
        if endpoint is not None and endpoint.rank != 0:
            raise ValueError(
                f"the engine core runs on rank 0; rank {endpoint.rank} runs a Worker only "
                "(engine/worker/tp_worker.py `run_worker`)"
            )
        self.config = config
        self.source: ModelSource = resolve_model(config.model.model)
        mc = self.model_config = self.source.config
        # An embedding model pools each prompt's hidden states (engine/worker/pooler.py).
        self.pooling = embedding_pooling(self.source, config.model.task)
        self.max_model_len = config.model.model_len(context_length(mc, self.pooling))
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc)
        self.worker = Worker(config, self.source, self.max_model_len, endpoint)
        try:
            self._build(config)
        except BaseException:
            self.worker.close()  # the ranks it started, if any
            raise

    def _build(self, config: EngineConfig) -> None:
        mc = self.model_config
        self.max_num_batched_tokens = config.scheduler.step_token_budget
        embeds = self.pooling is not None
        if embeds:  # a prompt runs whole in one step
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        plan = self.worker.kv_plan
        # Asynchronous scheduling: the step launched last, whose outputs the next step() reads.
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.scheduler = Scheduler(
            scheduler_config(
                config.scheduler,
                config.cache,
                config.speculative,
                config.lora,
                plan,
                num_host_blocks=self.worker.num_host_blocks,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                model_config=mc,
                embeds=embeds,
            )
        )
        # Structured outputs: the grammars compiling (their samples wait in the scheduler,
        # passed by until then) and the matchers of the constrained samples.
        self.structured = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, config.model.json_any_whitespace
        )
        self.worker.use_sampling_rules(self.structured, frozenset(self.eos_token_ids))
        self.num_steps = 0
        self.step_seconds = 0.0
        self.num_requests_added = 0  # requests (not samples) add_samples took (see EngineStats)
        self._rejected: list[SampleOutput] = []  # failed in add_samples, reported by the next step
        self.beams = BeamSearches(self.scheduler, self.eos_token_ids)
        self.kv_events = self._start_kv_events(config.observability, config.parallel)

    def _start_kv_events(
        self, observability: ObservabilityOptions, parallel: ParallelOptions
    ) -> KVEventPublisher | None:
        """The KV events' publisher, with the block pool telling the log it drains every step
        (None without --kv-events-config, or without a prefix cache to report on)."""
        events = observability.kv_events
        kv = self.scheduler.kv_cache_manager
        if events is None:
            return None
        if not kv.enable_prefix_caching:  # encoder-decoder and embedding models have none
            logger.warning("KV events: this model runs without a prefix cache; none are sent")
            return None
        kv.block_pool.event_log = KVEventLog(kv.block_size)
        medium = "GPU" if self.worker.device.type == "cuda" else "CPU"
        publisher = KVEventPublisher(
            events, parallel.data_parallel_rank, medium, self.worker.kv_plan.windows
        )
        logger.info("KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint)
        # Batch 0: a router that knew this rank before (a restarted pod) forgets its blocks.
        publisher.publish([AllBlocksCleared()])
        return publisher

    # ---- samples ---------------------------------------------------------------------------------

    def add_samples(self, samples: list[CoreRequest]) -> None:
        """Queue the samples of one request. They share its prompt: the first computes it, the
        others fork its blocks once it has (`Scheduler.add_request`'s fork_parent). With
        `use_beam_search` they are the slots of one beam search's results instead."""
        self.num_requests_added += 1
        params, lora = samples[0].params, samples[0].lora
        if lora is not None and not self._load_lora(samples):
            return
        spec = params.structured_outputs
        if spec is not None:  # admitted once the grammar has compiled (`_start_grammars`)
            self.structured.compile(spec, [sample.request_id for sample in samples])
        elif params.use_beam_search:
            self.beams.start(samples)
            return
        parent = None
        for sample in samples:
            request = Request(
                sample.request_id,
                sample.prompt_token_ids,
                sample.params,
                self.eos_token_ids,
                sample.arrival_time,
                sample.encoder_input,
                waiting_for_grammar=spec is not None,
                lora=sample.lora,
            )
            self.scheduler.add_request(request, fork_parent=parent)
            parent = parent or request

    def _load_lora(self, samples: list[CoreRequest]) -> bool:
        """Have the request's adapter in host memory before it is scheduled; when it cannot be
        read (its files went away after the front end checked them), fail its samples."""
        lora = samples[0].lora
        try:
            if self.worker.lora is None:
                raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
            self.worker.lora.add(lora)
        except ValueError as e:
            logger.error("adapter %r could not be loaded: %s", lora.lora_name, e)
            error = f"adapter {lora.lora_name!r} could not be loaded: {e}"
            self._rejected += [
                SampleOutput(s.request_id, [], "error", error=error) for s in samples
            ]
            return False
        return True

    def _start_grammars(self) -> list[SampleOutput]:
        """Let the samples whose grammar has compiled be admitted, each with a matcher of its
        own; fail those whose grammar did not. Waits for a compilation when nothing can run."""
        idle = self._in_flight is None and self.scheduler.only_grammars_awaited()
        outputs: list[SampleOutput] = []
        for request_ids, compiled in self.structured.compiled(wait=idle):
            live = [rid for rid in request_ids if rid in self.scheduler.requests]
            if isinstance(compiled, Exception):  # fails these samples only
                error = str(compiled)
                if not isinstance(compiled, ValueError):  # not a bad spec: a compiler's failure
                    error = f"grammar compilation failed: {compiled}"
                for request_id in live:
                    self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
                outputs += [SampleOutput(rid, [], "error", error=error) for rid in live]
                continue
            for request_id in live:
                self.structured.start(request_id, compiled)
                self.scheduler.grammar_ready(request_id)
        return outputs

    def abort_samples(self, request_ids: list[str], stopped: bool = False) -> None:
        """End samples in whatever state they are and free their blocks now; unknown or finished
        ids are ignored. `stopped`: the front end matched a stop string (else the client left)."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        for request_id in request_ids:
            if not self.beams.abort(request_id):
                self.scheduler.finish_request(request_id, status)
        if self.structured.matchers:
            self.structured.retain(self.scheduler.requests)

    def rewind_samples(self, request_ids: list[str], num_tokens: int) -> list[SampleOutput]:
        """Take back the last `num_tokens` output tokens of each of these samples
        (`Scheduler.rewind`); returns an output per sample carrying its new length
        (`rewound_to`). Samples that have ended since are skipped. Raises ValueError, changing
        nothing, when a live sample has fewer output tokens."""
        requests = [r for rid in request_ids if (r := self.scheduler.requests.get(rid))]
        for request in requests:
            if not 0 < num_tokens <= len(request.output_token_ids):
                raise ValueError(
                    f"cannot rewind by {num_tokens} tokens: sample {request.request_id!r} has "
                    f"{len(request.output_token_ids)} output tokens"
                )
        outputs = []
        for r in requests:
            rewound_to = self.scheduler.rewind(r.request_id, num_tokens)
            self.structured.restart(r.request_id, r.output_token_ids)
            outputs.append(SampleOutput(r.request_id, [], rewound_to=rewound_to))
        self._publish_kv_events()  # (blocks cut back leave the cache now, not at the next step)
        return outputs

    def has_work(self) -> bool:
        """Samples to schedule, a launched step whose results are still to be read, or failures
        to report."""
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self._rejected)
        )

    # ---- stepping --------------------------------------------------------------------------------

    def step_samples(self) -> list[SampleOutput]:
        """Run one scheduler step; return what it produced for each sample (tokens, finishes,
        logprobs, prompt logprobs).

        With asynchronous scheduling a call launches step N + 1 and then returns the outputs of
        step N, whose device work ran (and whose ids came back) meanwhile."""
        outputs = self._step()
        return self.beams.route(outputs) if self.beams else outputs

    def _step(self) -> list[SampleOutput]:
        start = time.perf_counter()
        try:
            early = self._start_grammars() if self.structured.compiling else []
            if self._rejected:
                early, self._rejected = self._rejected + early, []
            # A constrained sample's mask needs its last token: while any is live, steps run
            # one at a time (the one in flight is read first).
            if self.structured.matchers:
                self.structured.retain(self.scheduler.requests)  # aborted ones go
            constrained = bool(self.structured.matchers)
            if constrained and self._in_flight is not None:
                previous, self._in_flight = self._in_flight, None
                early += self._process(previous[0], previous[1].result())
            return early + self._schedule_and_run(synchronous=constrained)
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """What the prefix cache gained and lost since the last batch, as one batch."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv_cache_manager.block_pool.event_log.take())

    def _schedule_and_run(self, synchronous: bool) -> list[SampleOutput]:
        sched_out = self.scheduler.schedule()
        scheduled = bool(sched_out.num_scheduled_tokens)
        synchronous = synchronous or not self.worker.async_scheduling
        result = None
        try:
            handle = self.worker.launch(sched_out)
            result = handle.result() if synchronous and scheduled else None
        except Exception as exc:
            if not self.worker.recoverable(exc):
                raise
            failed, handle, scheduled = self._fail_step(sched_out, exc), None, False
        else:
            failed = []
        if synchronous:
            return failed + (self._process(sched_out, result) if result is not None else [])
        previous = self._in_flight
        self._in_flight = (sched_out, handle) if scheduled else None
        if previous is None:
            return failed
        return failed + self._process(previous[0], previous[1].result())

    def _fail_step(self, sched_out: SchedulerOutput, exc: BaseException) -> list[SampleOutput]:
        """A step ran out of device memory: fail the request with the most tokens in it (a large
        prefill chunk, as a rule) and recompute the others later; the engine goes on."""
        scheduled = sched_out.num_scheduled_tokens
        # The largest share; among equals the newest request (the last in batch order).
        culprit = max(reversed(scheduled), key=scheduled.__getitem__)
        logger.error(
            "step %d ran out of memory (%s): failing request %s (%d of its %d tokens), "
            "recomputing the other %d requests",
            sched_out.step_id,
            exc,
            culprit,
            scheduled[culprit],
            sched_out.total_num_scheduled_tokens,
            len(scheduled) - 1,
        )
        self.scheduler.finish_request(culprit, RequestStatus.FINISHED_ERROR)
        self.scheduler.undo_step(sched_out)
        message = (
            f"the server ran out of memory computing {scheduled[culprit]} tokens of this "
            "request; retry with a shorter prompt (the server's --max-num-batched-tokens bounds "
            "the tokens of one step)"
        )
        return [SampleOutput(culprit, [], "error", error=message)]

    def _fail_nonfinite(self, request_ids: list[str]) -> list[SampleOutput]:
        """Fail the requests whose logits held NaN or inf; their blocks are cleared for reuse."""
        logger.error(
            "the model produced NaN or infinite logits for %d request(s) (%s): failing them",
            len(request_ids),
            ", ".join(request_ids),
        )
        block_ids = []
        outputs = []
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            # The sampler fails a row that its token rules left no token the same way.
            ruled = request is not None and request.sampling_params.has_token_rules
            block_ids += self.scheduler.fail_request(request_id)
            message = (
                "the model produced non-finite logits (NaN or infinity) for this request, so it "
                "was stopped instead of sampling from them"
            )
            if ruled:
                message = (
                    "no token could be sampled: allowed_token_ids, bad_words, min_tokens and "
                    "the structured output left none (or the model produced non-finite logits)"
                )
            outputs.append(SampleOutput(request_id, [], "error", error=message))
        self.worker.clear_blocks(block_ids)
        return outputs

    def _process(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[SampleOutput]:
        """Apply a step's sampled tokens to the scheduler; one output per sample touched."""
        failed = []
        if runner_out.nonfinite_request_ids:  # first: update_from_output then skips them
            failed = self._fail_nonfinite(runner_out.nonfinite_request_ids)
        logprobs = runner_out.logprobs
        outputs = failed + [
            SampleOutput(
                delta.request_id,
                list(delta.new_token_ids),
                delta.finish_reason,
                logprobs.get(delta.request_id),
            )
            for delta in self.scheduler.update_from_output(
                sched_out, runner_out.sampled_token_ids, runner_out.accepted_token_ids
            )
        ]
        if self.structured.matchers:
            outputs = self._follow_grammars(outputs)
        if runner_out.pooled:  # embeddings: each finishes with its vector (little-endian f32)
            for out in outputs:
                vector = runner_out.pooled.get(out.request_id)
                if vector is not None:
                    out.embedding = vector.astype("<f4").tobytes()
        if not runner_out.prompt_logprobs:
            return outputs
        # A sample's first token comes in the step that scores its last prompt chunk: it carries
        # the rest of its prompt logprobs too. Samples still in their prompt get outputs without
        # tokens.
        by_id = {out.request_id: out for out in outputs}
        prompt_only = []
        for request_id, prompt_logprobs in runner_out.prompt_logprobs.items():
            out = by_id.get(request_id)
            if out is None:
                prompt_only.append(SampleOutput(request_id, [], prompt_logprobs=prompt_logprobs))
            else:
                out.prompt_logprobs = prompt_logprobs
        return prompt_only + outputs

    def _follow_grammars(self, outputs: list[SampleOutput]) -> list[SampleOutput]:
        """Advance the constrained samples' matchers by their new tokens. A grammar that is
        complete ends its sample ("stop") even when it ignores EOS; a token the grammar refuses
        (only a bug could sample one) fails it."""
        structured = self.structured
        for out in outputs:
            request_id = out.request_id
            if request_id not in structured.matchers or not out.new_token_ids:
                continue
            if not structured.accept(request_id, out.new_token_ids):
                logger.error("request %s sampled a token its grammar refuses", request_id)
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
                out.finish_reason = "error"
                out.error = "the engine sampled a token the request's grammar does not allow"
            elif out.finish_reason is None and structured.is_terminated(request_id):
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
                out.finish_reason = "stop"
        structured.retain(self.scheduler.requests)
        return outputs

    def close(self) -> None:
        """Stop the worker's other ranks, if any, and the KV events' publisher. Safe to call
        more than once."""
        if self.kv_events is not None:
            self.kv_events.close()
        self.worker.close()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_total_blocks,
            num_preemptions=scheduler.num_preemptions,
            spec_draft_tokens=scheduler.num_draft_tokens,
            spec_accepted_tokens=scheduler.num_accepted_tokens,
            prefix_cache_queries=kv.num_prefix_cache_queries_tokens,
            prefix_cache_hits=kv.num_prefix_cache_hits_tokens,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            num_requests_added=self.num_requests_added,
            kv_host_blocks_used=kv.num_swapped_blocks,
            kv_host_blocks_total=self.worker.num_host_blocks,
            num_swap_outs=scheduler.num_swap_outs,
            num_swap_ins=scheduler.num_swap_ins,
            block_size=kv.block_size,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        lora = self.worker.lora
        if lora is None:
            return {}
        running, waiting = self.scheduler.lora_names()
        return dict(
            running_loras=running,
            waiting_loras=waiting,
            max_loras=lora.max_loras,
            lora_slot_loads=lora.num_slot_loads,
        )

    def kv_map(self) -> bytes:
        """The live block map as JSON (GET /v1/kv): the scheduler's view of every block and
        request (`Scheduler.kv_map`) and what the cache is made of."""
        kv_map = self.scheduler.kv_map()
        kv_map.update(
            time=time.time(),
            model=self.config.model.model,
            kv_cache_dtype=dtype_name(self.worker.kv_cache_dtype),
            bytes_per_block=self.worker.kv_plan.bytes_per_block,
            max_model_len=self.max_model_len,
        )
        return msgspec.json.encode(kv_map)

    def describe(self) -> str:
        """Device, dtype and KV cache, as the server's start-up line gives them."""
        plan = self.worker.kv_plan
        encoder = f", {plan.encoder_blocks} of a request's for cross-attention" * bool(
            plan.encoder_blocks
        )
        return (
            f"{self.worker.describe()}, {plan.num_blocks} KV blocks "
            f"of {plan.block_size} tokens ({len(plan.groups)} layer groups{encoder}), "
            f"{plan.bytes_per_block} bytes/block, max concurrency "
            f"{plan.max_concurrency:.1f} at {plan.max_model_len} tokens"
        )
