"""The worker: one rank's model on its device, and the steps it runs.

It builds the model (weights, kept-quantized or packed matmul weights), sizes the KV cache (on
CUDA by profiling the largest step), allocates it, captures CUDA graphs for decode steps, and
launches the scheduler's steps on the model runner. With tensor parallelism over N ranks
(engine/models/parallel.py) rank 0's worker starts ranks 1..N-1 (engine/worker/tp_worker.py) or
joins those torchrun started, and sends each of them every step and block clear; the other ranks
build a worker only, and run `serve` until rank 0 says stop. The engine core above never asks
which rank it is on: it always runs on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pagedserve import kernels
from pagedserve.engine.engine_config import EngineConfig, LoRAOptions
from pagedserve.engine.lora.slots import LoRAManager
from pagedserve.engine.models.bert_config import embedding_pooling
from pagedserve.engine.models.model import CausalLM
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import ModelSource
from pagedserve.engine.models.parallel import TPGroup, describe_shards, plan_shards
from pagedserve.engine.models.quantized_linear import quantized
from pagedserve.engine.models.whisper_config import WhisperDecoding
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
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.model_runner import ModelRunner, StepHandle, profile_step
from pagedserve.scheduler import SchedulerOutput
from pagedserve.scheduler.utils import cdiv

logger = logging.getLogger("pagedserve")


class Worker:
    """One rank's model, KV cache and runner. `endpoint` None: rank 0 (alone, or the ranks
    started here, or torchrun's rank 0); otherwise the rank it names."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        max_model_len: int,
        endpoint: TPEndpoint | None = None,
    ) -> None:
        self.config, self.source, self.max_model_len = config, source, max_model_len
        mc = self.model_config = source.config
        self.tp: TPGroup | None = None
        self._workers = None  # rank 0 on one node: the worker processes it started
        self._stop_ranks = False  # whether close() has other ranks to tell
        self.shard = None
        self.kv_config = mc  # the KV heads this rank holds: all of them without a shard
        size = config.parallel.tensor_parallel_size
        # An endpoint of one rank takes the distributed path alone (its cost, measured).
        distributed = size > 1 or endpoint is not None
        if distributed:
            self.shard = plan_shards(mc, size)[0 if endpoint is None else endpoint.rank]
            self.kv_config = self.shard.local_config(mc)
        self.device = config.model.torch_device()
        if mc.is_encoder_decoder or mc.is_encoder_only:
            config.check_encoder_model("Whisper" if mc.is_encoder_decoder else "BERT")
        self.pooling = embedding_pooling(source, config.model.task)
        try:
            if distributed:
                self.tp = self._join_ranks(endpoint)
            self._build(config, mc)
        except BaseException:
            self.close()
            raise
        self._stop_ranks = self.tp is not None  # the other ranks are in their loop now

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank the engine core runs on."""
        return self.tp is None or self.tp.is_driver

    def _join_ranks(self, endpoint: TPEndpoint | None) -> TPGroup:
        """Find the other ranks (starting them when this is rank 0 on its own), set this rank's
        device and CPU share, and connect."""
        config, size = self.config, self.config.parallel.tensor_parallel_size
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
        self.dtype = config.model.torch_dtype(self.device)
        self.kv_cache_dtype = config.cache.torch_kv_cache_dtype(self.dtype)
        self.attention_backend = kernels.resolve_backend(
            config.model.attention_backend, self.device
        )
        self.attention_ops = kernels.get_backend(self.attention_backend)
        if self.attention_backend == "triton":  # refuse now, not at the first step after loading
            self.attention_ops.check_runnable(self.device)

        start = time.perf_counter()
        self.model = load_model(
            config.model,
            self.source,
            self.device,
            self.dtype,
            self.kv_cache_dtype,
            self.attention_ops,
            self.max_model_len,
            shard=self.shard,
            tp=self.tp,
            log=self.is_driver,
        )
        # A weight kept quantized holds no dense elements: count its shape.
        self.num_params = sum(
            kept.out_features * kept.in_features if (kept := quantized(p)) else p.numel()
            for p in self.model.parameters()
        )
        logger.info(
            "model %s (%s): %.1fM parameters, %s on %s, %s attention, loaded in %.1f s",
            config.model.model,
            mc.architecture,
            self.num_params / 1e6,
            dtype_name(self.dtype),
            self.device,
            self.attention_backend,
            time.perf_counter() - start,
        )
        self.lora = self._build_lora(config.lora, config.scheduler.step_token_budget)

        kv_memory = config.cache.kv_cache_memory
        num_kv_blocks = config.cache.num_kv_blocks
        if mc.is_encoder_only and num_kv_blocks is None:
            # It keeps no KV: the blocks only count what the scheduler admits (every sequence
            # at its longest), and no memory backs them.
            num_kv_blocks = config.scheduler.max_num_seqs * cdiv(
                self.max_model_len, config.cache.block_size
            )
        if self.device.type == "cuda" and kv_memory is None and num_kv_blocks is None:
            if mc.is_encoder_decoder:  # (its profile step would need encoder inputs)
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_memory = int(free * config.cache.gpu_memory_utilization)
            else:
                kv_memory = self._profile_kv_cache_budget()
        self.kv_plan: KVCachePlan = plan_kv_cache(
            self.kv_config,
            self.kv_cache_dtype,
            config.cache.block_size,
            self.max_model_len,
            memory_bytes=kv_memory,
            num_blocks=num_kv_blocks,
            max_chunk=config.scheduler.step_token_budget,
            encoder_blocks=(
                cdiv(mc.whisper.max_source_positions, config.cache.block_size)
                if mc.is_encoder_decoder
                else 0
            ),
        )
        if mc.is_encoder_only:  # blocks without memory: it keeps no KV
            self.kv_plan = dataclasses.replace(self.kv_plan, bytes_per_block=0)
        if self.tp is not None:  # one block table for all ranks: the fewest blocks any has room for
            num_blocks = self.tp.min_int(self.kv_plan.num_blocks)
            self.kv_plan = dataclasses.replace(self.kv_plan, num_blocks=num_blocks)
        if self.is_driver:
            logger.info(self.kv_plan.describe())
        self.num_host_blocks = 0
        if config.cache.preemption_mode == "swap":
            self.num_host_blocks = config.cache.swap_space // self.kv_plan.bytes_per_block
            logger.info(
                "swap preemption: %d host blocks (%.2f GiB%s)",
                self.num_host_blocks,
                self.num_host_blocks * self.kv_plan.bytes_per_block / GiB,
                ", pinned" if self.device.type == "cuda" else "",
            )
        kv_caches = (
            []
            if mc.is_encoder_only
            else allocate_kv_caches(self.kv_config, self.kv_plan, self.kv_cache_dtype, self.device)
        )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            config.cache.block_size,
            self.device,
            config.scheduler.max_num_seqs,
            self.max_model_len,
            config.model.seed,
            graphs=self._capture_with_lora(kv_caches),
            ops=self.attention_ops,
            windows=self.kv_plan.windows,
            num_host_blocks=self.num_host_blocks,
            tp=self.tp,
            suppress=self._suppressed_tokens(),
        )
        self.runner.lora = self.lora
        if self.pooling is not None:
            from pagedserve.engine.worker.pooler import Pooler

            self.runner.pooler = Pooler(self.pooling)
        # Off with speculative decoding: a step's drafts come from the tokens the previous
        # step accepted, so it cannot be scheduled before those are back.
        # Off for embeddings too: a request ends with the step that pools it.
        self.async_scheduling = self.pooling is None and (
            config.scheduler.async_scheduling
            if config.scheduler.async_scheduling is not None
            else self.device.type == "cuda" and not config.speculative.speculative_ngram
        )
        if config.cache.calculate_kv_scales:  # now: start-up's own forward passes are not data
            self.model.calibrate_kv_scales(self.kv_cache_dtype)

    def _build_lora(self, options: LoRAOptions, step_token_budget: int) -> LoRAManager | None:
        """The adapters' slots on the device, attached to the model's projections, when the
        engine serves LoRA adapters."""
        if not options.enable_lora:
            return None
        if not isinstance(self.model, CausalLM):
            raise ValueError(
                f"LoRA adapters apply to decoder models; {self.model_config.architecture} is not "
                "one: drop --enable-lora"
            )
        lora = LoRAManager(
            self.model,
            options.max_loras,
            options.max_lora_rank,
            options.num_cpu_loras,
            step_token_budget,
            self.dtype,
            self.device,
            base_config=self.model_config,
        )
        logger.info(
            "LoRA: %d adapter slots up to rank %d, %.1f MiB on %s; %d adapters kept in host memory",
            options.max_loras,
            options.max_lora_rank,
            lora.num_bytes / 2**20,
            self.device,
            options.num_cpu_loras,
        )
        return lora

    def _capture_with_lora(self, kv_caches: list) -> DecodeGraphs | None:
        """The decode graphs, captured with the adapters' kernels in them when the engine serves
        adapters (every token on no slot then: a replay reads the step's slots)."""
        if self.lora is None:
            return self._capture_decode_graphs(kv_caches)
        self.lora.step.active = True
        try:
            return self._capture_decode_graphs(kv_caches)
        finally:
            self.lora.step.clear()

    def _profile_kv_cache_budget(self) -> int:
        """GPU bytes for the KV cache: run the largest possible step once (all of the step's
        token budget, sampled by as many sequences as may run) on a scratch cache, measure its
        activation peak, and give the KV cache what the --gpu-memory-utilization share leaves
        after that peak and everything already in use."""
        device, mc, block_size = self.device, self.model_config, self.config.cache.block_size
        budget_tokens = self.config.scheduler.step_token_budget
        groups = mc.kv_cache_groups()
        step = profile_step(
            budget_tokens,
            self.config.scheduler.max_num_seqs,
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
            budget_tokens,
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
            self.config.model.seed,
            windows=scratch.windows,
            tp=self.tp,
        )
        runner.execute(step)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline - scratch.total_bytes
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        utilization = self.config.cache.gpu_memory_utilization
        budget = gpu_kv_cache_budget(total, utilization, total - free, peak)
        logger.info(
            "GPU memory: %.1f GiB total, %.2f GiB in use (weights %.2f GiB), %.2f GiB activation "
            "peak for a %d-token step; KV cache gets %.2f GiB (--gpu-memory-utilization %.2f)",
            total / GiB,
            (total - free) / GiB,
            sum(p.numel() * p.element_size() for p in self.model.parameters()) / GiB,
            peak / GiB,
            budget_tokens,
            budget / GiB,
            utilization,
        )
        return budget

    def _suppressed_tokens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(tokens never sampled, tokens never sampled first): Whisper's generation config, as
        transformers' `generate` applies it; none for other models. Ids past the vocabulary are
        dropped (transformers' default config names GPT-2's 220 and 50256)."""
        mc = self.model_config
        if not mc.is_encoder_decoder:
            return (), ()
        decoding = WhisperDecoding.of(str(self.source.path or self.source.name))
        kept = lambda ids: tuple(sorted({i for i in ids if 0 <= i < mc.vocab_size}))  # noqa: E731
        return kept(decoding.suppress_tokens), kept(decoding.begin_suppress_tokens)

    def _capture_decode_graphs(self, kv_caches: list) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, unless on CPU, --enforce-eager, an attention backend
        that synchronises with the host (the torch reference cannot be captured), or an
        encoder-decoder (its steps read cross-attention tables the graphs do not hold)."""
        if (
            self.device.type != "cuda"
            or self.config.model.enforce_eager
            or self.pooling is not None
        ):
            return None  # (an embedding step is a whole prompt, never a decode step)
        if self.model_config.is_encoder_decoder:
            logger.info("CUDA graphs off: Whisper's decoder steps run eagerly")
            return None
        if self.attention_backend != "triton":
            logger.info(
                "CUDA graphs off: the %s attention backend cannot be captured",
                self.attention_backend,
            )
            return None
        max_batch = min(
            self.config.model.max_cuda_graph_batch_size or self.config.scheduler.max_num_seqs,
            self.config.scheduler.max_num_seqs,
            MAX_CAPTURE_BATCH_SIZE,
        )
        graphs = DecodeGraphs(
            self.model,
            kv_caches,
            max_batch,
            cdiv(self.max_model_len, self.config.cache.block_size),
            self.device,
            num_groups=len(self.model_config.kv_cache_groups()),
        )
        graphs.capture_all()
        return graphs

    # ---- steps (rank 0) --------------------------------------------------------------------------

    def use_sampling_rules(
        self, structured: StructuredOutputManager, eos_token_ids: frozenset[int]
    ) -> None:
        """The core's grammars, which mask each step's logits, and its EOS ids, which min_tokens
        keeps the sampler from picking too early."""
        self.runner.structured = structured
        self.runner.sampler.eos_token_ids = eos_token_ids

    def launch(self, sched_out: SchedulerOutput) -> StepHandle:
        """Start a step on every rank; its sampled ids come from the handle."""
        if self.tp is not None:
            self.tp.send(("step", sched_out))
        return self.runner.launch(sched_out)  # also when empty: drops finished requests

    def recoverable(self, exc: BaseException) -> bool:
        """Whether the engine may go on after a step raised `exc`: the step ran out of memory,
        on one rank (with several, the ranks would not agree on what the step did)."""
        return is_out_of_memory(exc) and self.tp is None

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero these blocks' KV on every rank."""
        if self.tp is not None:
            self.tp.send(("clear", block_ids))
        self.runner.clear_blocks(block_ids)

    def describe(self) -> str:
        """Device, dtypes and the ranks, for the start-up line."""
        kv_dtype = ""
        if self.kv_cache_dtype != self.dtype:
            kv_dtype = f", KV cache {dtype_name(self.kv_cache_dtype)}"
        tp = ""
        if self.tp is not None:
            tp = f", tensor parallel over {self.tp.size} ranks (rank 0's share of the KV cache)"
        return f"device {self.device}, dtype {dtype_name(self.dtype)}{kv_dtype}{tp}"

    # ---- ranks 1..N-1 ----------------------------------------------------------------------------

    def serve(self) -> None:
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
        """Rank 0 of several: tell the other ranks to stop, and wait for those it started. Safe
        to call more than once, and on any rank."""
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


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: CUDA's caching allocator, or the CPU allocator (which raises a
    plain RuntimeError) when the operating system refuses the memory."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
