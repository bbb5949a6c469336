"""EngineCore: the model side of the engine, one step = schedule -> run model -> update.

It knows samples (one scheduler request each) and token ids; text is the front end's
(engine/frontend/output_processor.py). Token-level stops (EOS, stop token ids, max_tokens,
max_model_len) are the scheduler's; a stop string found by the front end comes back as
`finish_samples`. `LLMEngine` runs a core in the caller's process; engine/frontend/process_client.py
runs one in its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import msgspec
import torch

from pagedserve import kernels
from pagedserve.engine.core.beam_search import BeamSearch, start_beam_search
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.messages import CoreRequest, EngineStats, SampleOutput
from pagedserve.engine.models.cpu_linear import can_pack
from pagedserve.engine.models.model import CausalLM
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import ModelSource, resolve_model
from pagedserve.engine.models.parallel import TPGroup, describe_shards, plan_shards
from pagedserve.engine.models.quantized_linear import describe, keep_quantized
from pagedserve.engine.models.tokenizer import eos_token_ids, load_tokenizer
from pagedserve.engine.models.weights import load_weights
from pagedserve.engine.structured_output import StructuredOutputManager
from pagedserve.engine.tp_endpoint import TPEndpoint, free_port
from pagedserve.engine.worker.cuda_graph import MAX_CAPTURE_BATCH_SIZE, DecodeGraphs
from pagedserve.engine.worker.kv_cache import (
    GiB,
    KVCachePlan,
    allocate_kv_caches,
    bytes_per_block,
    gpu_kv_cache_budget,
    plan_kv_cache,
)
from pagedserve.engine.worker.model_runner import (
    ModelRunner,
    RunnerOutput,
    StepHandle,
    profile_step,
)
from pagedserve.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedserve.scheduler.utils import cdiv

logger = logging.getLogger("pagedserve")


class EngineCore:
    """The model side of the engine: weights, KV cache, scheduler and runner. Takes samples
    (`add_samples`), steps them, returns what each step produced (`step_samples`).

    With `tensor_parallel_size` N > 1 this is rank 0 of N (engine/models/parallel.py): it starts
    ranks 1..N-1 (engine/worker/tp_worker.py), or joins those torchrun started, and sends them each
    step. `endpoint` makes it another rank instead, which only runs `serve_as_worker()`."""

    def __init__(self, config: EngineConfig, endpoint: TPEndpoint | None = None) -> None:
        self.config = config
        self.source: ModelSource = resolve_model(config.model)
        self.model_config: ModelConfig = self.source.config
        mc = self.model_config
        self.max_model_len = config.model_len(mc.max_position_embeddings)
        self.tp: TPGroup | None = None
        self._workers = None  # rank 0 on one node: the worker processes it started
        self._stop_ranks = False  # whether close() has other ranks to tell
        self.shard = None
        self.kv_config = mc  # the KV heads this rank holds: all of them without a shard
        size = config.tensor_parallel_size
        # An endpoint of one rank takes the distributed path alone (its cost, measured).
        distributed = size > 1 or endpoint is not None
        if distributed:
            self.shard = plan_shards(mc, size)[0 if endpoint is None else endpoint.rank]
            self.kv_config = self.shard.local_config(mc)
        self.device = config.torch_device()
        try:
            if distributed:
                self.tp = self._join_ranks(endpoint)
            self._build(config, mc)
        except BaseException:
            self.close()
            raise
        self._stop_ranks = self.tp is not None  # the other ranks are in their loop now

    def _join_ranks(self, endpoint: TPEndpoint | None) -> TPGroup:
        """Find the other ranks (starting them when this is rank 0 on its own), set this rank's
        device and CPU share, and connect."""
        config, size = self.config, self.config.tensor_parallel_size
        if endpoint is None:
            endpoint = TPEndpoint.from_torchrun()
            if endpoint is not None and endpoint.rank != 0:
                raise ValueError(
                    f"torchrun rank {endpoint.rank} must run the worker (`pagedserve serve` does)"
                )
        if endpoint is not None and endpoint.size != size:
            raise ValueError(
                f"--tensor-parallel-size {size} but torchrun started {endpoint.size} ranks "
                "(WORLD_SIZE): they must be equal"
            )
        if endpoint is None:  # rank 0 on one node: start the others
            threads = max(1, torch.get_num_threads() // size)
            endpoint = TPEndpoint(0, size, "127.0.0.1", free_port(), 0, threads)
            from pagedserve.engine.worker.tp_worker import start_workers

            self._workers = start_workers(config, endpoint)
            self._workers.watch()
        if self.device.type == "cuda":  # the ranks count from the configured GPU
            self.device = torch.device("cuda", (self.device.index or 0) + endpoint.local_rank)
            torch.cuda.set_device(self.device)
        elif endpoint.num_threads is not None:
            torch.set_num_threads(endpoint.num_threads)
        tp = TPGroup(endpoint, self.device)
        if tp.is_driver:
            logger.info(describe_shards(self.model_config, plan_shards(self.model_config, size)))
        return tp

    def _build(self, config: EngineConfig, mc: ModelConfig) -> None:
        self.dtype = config.torch_dtype(self.device)
        self.kv_cache_dtype = config.torch_kv_cache_dtype(self.dtype)
        self.attention_backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.attention_ops = kernels.get_backend(self.attention_backend)
        if self.attention_backend == "triton":  # refuse now, not at the first step after loading
            self.attention_ops.check_runnable(self.device)
        # Ranks 1..N-1 of a tensor-parallel engine see token ids only.
        self.is_driver = self.tp is None or self.tp.is_driver
        self.tokenizer = load_tokenizer(self.source, config.tokenizer) if self.is_driver else None
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc) if self.is_driver else ()

        start = time.perf_counter()
        self.model = self._build_model()
        self.num_params = sum(p.numel() for p in self.model.parameters())
        logger.info(
            "model %s (%s): %.1fM parameters, %s on %s, %s attention, loaded in %.1f s",
            config.model,
            mc.architecture,
            self.num_params / 1e6,
            _dtype_name(self.dtype),
            self.device,
            self.attention_backend,
            time.perf_counter() - start,
        )

        self.max_num_batched_tokens = config.step_token_budget
        kv_memory = config.kv_cache_memory
        if self.device.type == "cuda" and kv_memory is None and config.num_kv_blocks is None:
            kv_memory = self._profile_kv_cache_budget()
        self.kv_plan: KVCachePlan = plan_kv_cache(
            self.kv_config,
            self.kv_cache_dtype,
            config.block_size,
            self.max_model_len,
            memory_bytes=kv_memory,
            num_blocks=config.num_kv_blocks,
            max_chunk=self.max_num_batched_tokens,
        )
        if self.tp is not None:  # one block table for all ranks: the fewest blocks any has room for
            num_blocks = self.tp.min_int(self.kv_plan.num_blocks)
            self.kv_plan = dataclasses.replace(self.kv_plan, num_blocks=num_blocks)
        if self.is_driver:
            logger.info(self.kv_plan.describe())
        self.num_host_blocks = 0
        if config.preemption_mode == "swap":
            self.num_host_blocks = config.swap_space // self.kv_plan.bytes_per_block
            logger.info(
                "swap preemption: %d host blocks (%.2f GiB%s)",
                self.num_host_blocks,
                self.num_host_blocks * self.kv_plan.bytes_per_block / GiB,
                ", pinned" if self.device.type == "cuda" else "",
            )
        kv_caches = allocate_kv_caches(
            self.kv_config, self.kv_plan, self.kv_cache_dtype, self.device
        )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            config.block_size,
            self.device,
            config.max_num_seqs,
            self.max_model_len,
            config.seed,
            graphs=self._capture_decode_graphs(kv_caches),
            ops=self.attention_ops,
            windows=self.kv_plan.windows,
            num_host_blocks=self.num_host_blocks,
            tp=self.tp,
        )
        # Off with speculative decoding: a step's drafts come from the tokens the previous
        # step accepted, so it cannot be scheduled before those are back.
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda" and not config.speculative_ngram
        )
        # Asynchronous scheduling: the step launched last, whose outputs the next step() reads.
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.kv_plan.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                num_speculative_tokens=config.speculative_ngram,
                ngram_min=config.speculative_ngram_min,
                ngram_max=config.speculative_ngram_max,
                kv_group_windows=self.kv_plan.windows,
                num_host_blocks=self.num_host_blocks,
                max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding or 0,
            )
        )
        # Structured outputs: grammars compiling (their samples wait here, not in the
        # scheduler) and the matchers of the constrained samples.
        self.structured = (
            StructuredOutputManager(
                self.tokenizer, mc.vocab_size, self.eos_token_ids, config.json_any_whitespace
            )
            if self.is_driver
            else None
        )
        self.runner.structured = self.structured
        if config.calculate_kv_scales:  # now: start-up's own forward passes are not data
            self.model.calibrate_kv_scales(self.kv_cache_dtype)
        self._compiling: list[tuple[list[CoreRequest], Future]] = []
        self.num_steps = 0
        self.step_seconds = 0.0
        self.num_requests_added = 0  # requests (not samples) add_samples took (see EngineStats)
        # Beam searches, by the ids of their live beams and by their samples' ids.
        self._beam_of: dict[str, BeamSearch] = {}
        self._search_of_sample: dict[str, BeamSearch] = {}
        beam_ids = itertools.count()
        self._new_beam_id = lambda: f"beam-{next(beam_ids)}"

    def _build_model(self) -> CausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(
                    self.model_config,
                    self.max_model_len,
                    attention_ops=self.attention_ops,
                    shard=self.shard,
                    tp=self.tp,
                )
        finally:
            torch.set_default_dtype(previous)
        keep = keep_quantized(
            self.config.quantization,
            self.source.kind,
            self.device,
            self.dtype,
            sharded=self.shard is not None,
        )
        weights = load_weights(self.source, self.config.load_format, keep_quantized=keep)
        if self.shard is not None:
            weights = self.shard.slice_weights(weights, self.model_config)
        model.load_weights(weights)
        model.use_kv_cache_dtype(self.kv_cache_dtype)
        kept = model.prepare_matmul_weights(pack_dense=can_pack(self.device, self.dtype))
        if kept and self.is_driver:
            logger.info(describe(kept, self.dtype))
        return model.eval()

    def _profile_kv_cache_budget(self) -> int:
        """GPU bytes for the KV cache: run the largest possible step once (all of
        max_num_batched_tokens, sampled by as many sequences as may run) on a scratch cache,
        measure its activation peak, and give the KV cache what the --gpu-memory-utilization
        share leaves after that peak and everything already in use."""
        device, mc, block_size = self.device, self.model_config, self.config.block_size
        groups = mc.kv_cache_groups()
        step = profile_step(
            self.max_num_batched_tokens,
            self.config.max_num_seqs,
            block_size,
            self.max_model_len,
            mc.vocab_size,
            len(groups),
        )
        num_blocks = sum(len(new.block_ids) for new in step.new_requests)
        scratch = KVCachePlan(
            num_blocks,
            block_size,
            bytes_per_block(self.kv_config, groups, self.kv_cache_dtype, block_size),
            self.max_model_len,
            groups,
            self.max_num_batched_tokens,
        )
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        caches = allocate_kv_caches(self.kv_config, scratch, self.kv_cache_dtype, device)
        runner = ModelRunner(
            self.model,
            caches,
            block_size,
            device,
            len(step.new_requests),
            self.max_model_len,
            self.config.seed,
            windows=scratch.windows,
            tp=self.tp,
        )
        runner.execute(step)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline - scratch.total_bytes
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        utilization = self.config.gpu_memory_utilization
        budget = gpu_kv_cache_budget(total, utilization, total - free, peak)
        logger.info(
            "GPU memory: %.1f GiB total, %.2f GiB in use (weights %.2f GiB), %.2f GiB activation "
            "peak for a %d-token step; KV cache gets %.2f GiB (--gpu-memory-utilization %.2f)",
            total / GiB,
            (total - free) / GiB,
            sum(p.numel() * p.element_size() for p in self.model.parameters()) / GiB,
            peak / GiB,
            self.max_num_batched_tokens,
            budget / GiB,
            utilization,
        )
        return budget

    def _capture_decode_graphs(self, kv_caches: list) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, unless on CPU, --enforce-eager, or an attention backend
        that synchronises with the host (the torch reference cannot be captured)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.attention_backend != "triton":
            logger.info(
                "CUDA graphs off: the %s attention backend cannot be captured",
                self.attention_backend,
            )
            return None
        max_batch = min(
            self.config.max_cuda_graph_batch_size or self.config.max_num_seqs,
            self.config.max_num_seqs,
            MAX_CAPTURE_BATCH_SIZE,
        )
        graphs = DecodeGraphs(
            self.model,
            kv_caches,
            max_batch,
            cdiv(self.max_model_len, self.config.block_size),
            self.device,
            num_groups=len(self.model_config.kv_cache_groups()),
        )
        graphs.capture_all()
        return graphs

    # ---- samples ---------------------------------------------------------------------------------

    def add_samples(self, samples: list[CoreRequest]) -> None:
        """Queue the samples of one request. They share its prompt: the first computes it, the
        others fork its blocks once it has (`Scheduler.add_request`'s fork_parent). With
        `use_beam_search` they are the slots of one beam search's results instead."""
        self.num_requests_added += 1
        params = samples[0].params
        if params.structured_outputs is not None:
            # Scheduled once their grammar is compiled (`_admit_compiled`).
            future = self.structured.compile(params.structured_outputs)
            self._compiling.append((list(samples), future))
            return
        if params.use_beam_search:
            search, first = start_beam_search(samples, self.eos_token_ids, self._new_beam_id)
            self.scheduler.add_request(first)
            self._beam_of[first.request_id] = search
            for sample in samples:
                self._search_of_sample[sample.request_id] = search
            return
        self._schedule(samples)

    def _schedule(self, samples: list[CoreRequest]) -> None:
        parent = None
        for sample in samples:
            request = Request(
                sample.request_id,
                sample.prompt_token_ids,
                sample.params,
                self.eos_token_ids,
                sample.arrival_time,
            )
            self.scheduler.add_request(request, fork_parent=parent)
            parent = parent or request

    def _admit_compiled(self) -> list[SampleOutput]:
        """Schedule the samples whose grammar has compiled (each with a matcher of its own);
        fail those whose grammar did not. Waits for a compilation when nothing else can run."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            wait([future for _, future in self._compiling], return_when=FIRST_COMPLETED)
        outputs: list[SampleOutput] = []
        still = []
        for samples, future in self._compiling:
            if not future.done():
                still.append((samples, future))
                continue
            try:
                compiled = future.result()
            except Exception as e:  # noqa: BLE001 - any failure fails these samples only
                error = str(e) if isinstance(e, ValueError) else f"grammar compilation failed: {e}"
                outputs += [SampleOutput(s.request_id, [], "error", error=error) for s in samples]
                continue
            for sample in samples:
                self.structured.start(sample.request_id, compiled)
            self._schedule(samples)
        self._compiling = still
        return outputs

    def abort_samples(self, request_ids: list[str], stopped: bool = False) -> None:
        """End samples in whatever state they are and free their blocks now; unknown or finished
        ids are ignored. `stopped`: the front end matched a stop string (else the client left)."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        if self._compiling:
            gone = set(request_ids)
            self._compiling = [
                (kept, future)
                for samples, future in self._compiling
                if (kept := [s for s in samples if s.request_id not in gone])
            ]
        for request_id in request_ids:
            search = self._search_of_sample.get(request_id)
            if search is not None:
                self._drop_search(search)
            else:
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
        return outputs

    def has_work(self) -> bool:
        """Samples to schedule, or a launched step whose results are still to be read."""
        return (
            self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
            or bool(self._compiling)
        )

    # ---- stepping --------------------------------------------------------------------------------

    def step_samples(self) -> list[SampleOutput]:
        """Run one scheduler step; return what it produced for each sample (tokens, finishes,
        logprobs, prompt logprobs).

        With asynchronous scheduling a call launches step N + 1 and then returns the outputs of
        step N, whose device work ran (and whose ids came back) meanwhile."""
        outputs = self._step()
        return self._route_beams(outputs) if self._beam_of else outputs

    def _route_beams(self, outputs: list[SampleOutput]) -> list[SampleOutput]:
        """Beams' outputs go to their searches, which move on once every beam of theirs has
        its token; what comes out is a finished search's results (or a failed one's error)."""
        routed: list[SampleOutput] = []
        touched: dict[int, BeamSearch] = {}
        for out in outputs:
            search = self._beam_of.get(out.request_id)
            if search is None:
                routed.append(out)
            elif out.finish_reason == "error":  # the beam's step failed: so does the search
                routed.append(SampleOutput(search.sample_ids[0], [], "error", error=out.error))
                self._drop_search(search)
            elif out.new_token_ids:
                search.report(out)
                touched[id(search)] = search
        for search in touched.values():
            if search.sample_ids[0] not in self._search_of_sample or not search.round_done:
                continue  # dropped above, or still waiting for a beam
            before = list(search.beams)
            results = search.advance(self.scheduler)
            for beam_id in before:
                del self._beam_of[beam_id]
            if results:
                self._drop_search(search)
                routed += results
            else:
                self._beam_of.update(dict.fromkeys(search.beams, search))
        return routed

    def _drop_search(self, search: BeamSearch) -> None:
        """End a beam search: its beams' blocks are freed, its ids forgotten."""
        search.abort(self.scheduler)
        for beam_id in [b for b, s in self._beam_of.items() if s is search]:
            del self._beam_of[beam_id]
        for sample_id in search.sample_ids:
            self._search_of_sample.pop(sample_id, None)

    def _step(self) -> list[SampleOutput]:
        start = time.perf_counter()
        try:
            early = self._admit_compiled()
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

    def _schedule_and_run(self, synchronous: bool) -> list[SampleOutput]:
        sched_out = self.scheduler.schedule()
        scheduled = bool(sched_out.num_scheduled_tokens)
        synchronous = synchronous or not self.async_scheduling
        result = None
        try:
            if self.tp is not None:
                self.tp.send(("step", sched_out))
            handle = self.runner.launch(sched_out)  # also when empty: drops finished requests
            result = handle.result() if synchronous and scheduled else None
        except Exception as exc:
            # Tensor parallel: the ranks would not agree on what the step did.
            if not is_out_of_memory(exc) or self.tp is not None:
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
        for request_id in request_ids:
            block_ids += self.scheduler.fail_request(request_id)
        if self.tp is not None:
            self.tp.send(("clear", block_ids))
        self.runner.clear_blocks(block_ids)
        message = (
            "the model produced non-finite logits (NaN or infinity) for this request, so it was "
            "stopped instead of sampling from them"
        )
        return [SampleOutput(rid, [], "error", error=message) for rid in request_ids]

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

    # ---- tensor parallel -------------------------------------------------------------------------

    def serve_as_worker(self) -> None:
        """Ranks 1..N-1: run what rank 0 sends (its steps and block clears) until it says stop.
        Each step's ids are read after the next step is launched, as rank 0 does with async
        scheduling, and before it otherwise (drafts: the next step builds on what they kept)."""
        assert self.tp is not None and not self.tp.is_driver
        previous: StepHandle | None = None
        while True:
            message = self.tp.receive()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "clear":
                self.runner.clear_blocks(message[1])
                continue
            if previous is not None and not self.async_scheduling:
                previous.result()
            handle = self.runner.launch(message[1])
            if previous is not None:
                previous.result()
            previous = None if handle.done else handle

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine: tell the other ranks to stop, and wait for those
        it started. Safe to call more than once, and for any engine."""
        told = False
        tp, self._stop_ranks = (self.tp if self._stop_ranks else None), False
        if tp is not None and tp.is_driver:
            try:
                tp.send(("stop",))
                told = True
            except RuntimeError:  # a rank already gone
                pass
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.stop(timeout=10.0 if told else 0.0)

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
            kv_host_blocks_total=self.num_host_blocks,
            num_swap_outs=scheduler.num_swap_outs,
            num_swap_ins=scheduler.num_swap_ins,
        )

    def kv_map(self) -> bytes:
        """The live block map as JSON (GET /v1/kv): the scheduler's view of every block and
        request (`Scheduler.kv_map`) and what the cache is made of."""
        kv_map = self.scheduler.kv_map()
        kv_map.update(
            time=time.time(),
            model=self.config.model,
            kv_cache_dtype=_dtype_name(self.kv_cache_dtype),
            bytes_per_block=self.kv_plan.bytes_per_block,
            max_model_len=self.max_model_len,
        )
        return msgspec.json.encode(kv_map)

    def describe(self) -> str:
        """Device, dtype and KV cache, as the server's start-up line gives them."""
        plan = self.kv_plan
        kv_dtype = ""
        if self.kv_cache_dtype != self.dtype:
            kv_dtype = f", KV cache {_dtype_name(self.kv_cache_dtype)}"
        tp = ""
        if self.tp is not None:
            tp = f", tensor parallel over {self.tp.size} ranks (rank 0's share of the KV cache)"
        return (
            f"device {self.device}, dtype {_dtype_name(self.dtype)}{kv_dtype}{tp}, "
            f"{plan.num_blocks} KV blocks "
            f"of {plan.block_size} tokens ({len(plan.groups)} layer groups), "
            f"{plan.bytes_per_block} bytes/block, max concurrency "
            f"{plan.max_concurrency:.1f} at {plan.max_model_len} tokens"
        )


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: CUDA's caching allocator, or the CPU allocator (which raises a
    plain RuntimeError) when the operating system refuses the memory."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
