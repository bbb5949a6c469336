"""LLMEngine: add requests, step, collect outputs. One step = schedule -> run model -> update.

Each user request fans out into n scheduler requests (its samples). Token-level stops (EOS, stop
token ids, max_tokens, max_model_len) are the scheduler's; stop *strings* need text, so they are
checked here after detokenizing and end the sample through Scheduler.finish_request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kernels
from engine.cpu_linear import can_pack
from engine.cuda_graph import MAX_CAPTURE_BATCH_SIZE, DecodeGraphs
from engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from engine.engine_config import EngineConfig
from engine.inputs import Prompt
from engine.kv_cache import GiB, KVCachePlan, allocate_kv_caches, gpu_kv_cache_budget, plan_kv_cache
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, RunnerOutput, StepHandle, profile_step
from engine.model_source import ModelSource, resolve_model
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampler import TokenLogprobs
from engine.tokenizer import eos_token_ids, load_tokenizer
from engine.weights import load_weights
from scheduler import (
    Request,
    RequestDelta,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.utils import cdiv

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

    def output(self, finished: bool) -> RequestOutput | None:
        """This step's output in the request's `output_kind`, or None when it has none."""
        kind = self.params.output_kind
        if kind == "final" and not finished:
            return None
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
        )


class LLMEngine:
    """The synchronous core: owns the scheduler, the model runner and the tokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.source: ModelSource = resolve_model(config.model)
        self.model_config: ModelConfig = self.source.config
        mc = self.model_config
        self.max_model_len = config.model_len(mc.max_position_embeddings)
        self.attention_backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.attention_ops = kernels.get_backend(self.attention_backend)
        if self.attention_backend == "triton":  # refuse now, not at the first step after loading
            self.attention_ops.check_runnable(self.device)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc)

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
            mc,
            self.dtype,
            config.block_size,
            self.max_model_len,
            memory_bytes=kv_memory,
            num_blocks=config.num_kv_blocks,
        )
        logger.info(self.kv_plan.describe())
        kv_caches = allocate_kv_caches(mc, self.kv_plan, self.dtype, self.device)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            config.block_size,
            self.device,
            config.max_num_seqs,
            self.max_model_len,
            config.seed,
            graphs=self._capture_decode_graphs(kv_caches),
        )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda"
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
            )
        )
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}

    def _build_model(self) -> LlamaForCausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(
                    self.model_config,
                    self.max_model_len,
                    attention_ops=self.attention_ops,
                )
        finally:
            torch.set_default_dtype(previous)
        model.load_weights(load_weights(self.source, self.config.load_format))
        if can_pack(self.device, self.dtype):
            model.pack_linear_weights()
        return model.eval()

    def _profile_kv_cache_budget(self) -> int:
        """GPU bytes for the KV cache: run the largest possible step once (all of
        max_num_batched_tokens, sampled by as many sequences as may run) on a scratch cache,
        measure its activation peak, and give the KV cache what the --gpu-memory-utilization
        share leaves after that peak and everything already in use."""
        device, mc, block_size = self.device, self.model_config, self.config.block_size
        step = profile_step(
            self.max_num_batched_tokens,
            self.config.max_num_seqs,
            block_size,
            self.max_model_len,
            mc.vocab_size,
        )
        num_blocks = sum(len(s.block_table) for s in step.scheduled)
        scratch = KVCachePlan(
            num_blocks, block_size, mc.kv_bytes_per_token(self.dtype.itemsize), self.max_model_len
        )
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        caches = allocate_kv_caches(mc, scratch, self.dtype, device)
        runner = ModelRunner(
            self.model,
            caches,
            block_size,
            device,
            len(step.new_requests),
            self.max_model_len,
            self.config.seed,
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
        )
        graphs.capture_all()
        return graphs

    # ---- requests --------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def process_prompt(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """Where a prompt is checked, once: tokenize text, then refuse (ValueError) an empty
        prompt, ids outside the vocabulary, and a prompt that leaves no room for one output
        token. A Prompt is returned as it is. Safe from any thread: it reads only the tokenizer
        and the config."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            # "" is an empty prompt, not the bos token the tokenizer would add to it.
            text, token_ids = prompt, self.tokenize(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter to leave room for one output token"
            )
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return Prompt(token_ids, text)

    def process_inputs(
        self, prompt: str | Sequence[int] | Prompt, params: SamplingParams
    ) -> Prompt:
        """`process_prompt`, and the params' type (their values were checked when they were
        built)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        return self.process_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Prompt:
        """Check a request (`process_inputs`) and queue its n samples. `prompt` is text, token
        ids, or a Prompt from `process_prompt`. Returns the Prompt."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = self.process_inputs(prompt, params)
        self.enqueue(request_id, prompt, params, arrival_time)
        return prompt

    def enqueue(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose inputs `process_inputs` accepted (AsyncEngine checks them on the
        caller's thread, then queues them here on the engine's)."""
        assert request_id not in self._parents, f"request id {request_id!r} is already in use"
        prompt_token_ids = prompt.token_ids
        parent = _Parent(
            request_id, prompt.text, prompt_token_ids, params, arrival_time or time.time()
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        for k in range(params.n):
            # Sample k of a seeded request gets seed + k, so the n samples differ but reproduce.
            child_params = (
                params if params.seed is None or k == 0 else params.clone(seed=params.seed + k)
            )
            if params.n > 1:
                # The samples share the prompt: sample 0 alone scores it (and skips the prefix
                # cache for it); the others may reuse its cached blocks.
                child_params = child_params.clone(
                    n=1, prompt_logprobs=params.prompt_logprobs if k == 0 else None
                )
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
            self.scheduler.add_request(
                Request(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    parent.arrival_time,
                )
            )
        self._parents[request_id] = parent

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of a request in whatever state it is; its blocks are freed now.
        Returns its last output (None for an unknown id)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for k, sample in enumerate(parent.samples):
            child_id = _child_id(request_id, k)
            self.scheduler.abort(child_id)
            self._samples.pop(child_id, None)
            if not sample.output.finished:
                sample.output.finish_reason = "abort"
        return parent.output(finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- stepping --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that got new tokens, in
        its `SamplingParams.output_kind` (whole so far, what is new, or only the final one).

        With asynchronous scheduling a step() launches step N + 1 and then returns the outputs
        of step N, whose device work ran (and whose ids came back) meanwhile."""
        sched_out = self.scheduler.schedule()
        handle = self.runner.launch(sched_out)  # also when empty: it drops finished requests
        if not self.async_scheduling:
            if not sched_out.num_scheduled_tokens:
                return []
            return self._process(sched_out, handle.result())
        previous = self._in_flight
        self._in_flight = (sched_out, handle) if sched_out.num_scheduled_tokens else None
        if previous is None:
            return []
        return self._process(previous[0], previous[1].result())

    def _process(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's sampled tokens: scheduler update, detokenization, stop strings."""
        # Before the deltas: a sample's first token comes in the step that scores its last prompt
        # chunk, and that snapshot must carry the complete prompt logprobs.
        for child_id, (first_position, entries) in runner_out.prompt_logprobs.items():
            sample = self._samples.get(child_id)
            if sample is not None:
                self._record_prompt_logprobs(sample.parent, first_position, entries)
        deltas = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids)
        now = time.time()
        touched: dict[str, _Parent] = {}
        for delta in deltas:
            sample = self._samples.get(delta.request_id)
            if sample is None:
                continue
            parent = sample.parent
            if delta.new_token_ids and parent.first_token_time is None:
                parent.first_token_time = now
            self._append(delta.request_id, sample, delta, runner_out.logprobs.get(delta.request_id))
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            finished = all(s.output.finished for s in parent.samples)
            if finished:
                self._release(parent)
            output = parent.output(finished)
            if output is not None:
                results.append(output)
        return results

    def _append(
        self,
        child_id: str,
        sample: _Sample,
        delta: RequestDelta,
        logprobs: tuple[float, int, list[tuple[int, float]]] | None,
    ) -> None:
        out = sample.output
        params = sample.parent.params
        out.token_ids.extend(delta.new_token_ids)
        if logprobs is not None and out.logprobs is not None:
            out.logprobs.append(self._logprob_entry(delta.new_token_ids[-1], logprobs))
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + logprobs[0]

        if delta.finished:
            out.finish_reason = delta.finish_reason
            last = delta.new_token_ids[-1] if delta.new_token_ids else None
            if delta.status == RequestStatus.FINISHED_STOPPED and last in params.stop_token_ids:
                out.stop_reason = last
        new_text = sample.detokenizer.add_tokens(list(delta.new_token_ids))
        if delta.finished:
            new_text += sample.detokenizer.flush()  # bytes held for an unfinished character
        checked_from = len(sample.full_text)
        sample.full_text += new_text
        visible_end = len(sample.full_text)
        if params.stop:
            hit = find_stop(sample.full_text, params.stop, checked_from)
            if hit is not None:
                start, stop_str = hit
                visible_end = start + len(stop_str) if params.include_stop_str_in_output else start
                if not out.finished:
                    self.scheduler.finish_request(child_id, RequestStatus.FINISHED_STOPPED)
                # A stop string completed by the last allowed token still counts as a stop.
                out.finish_reason, out.stop_reason = "stop", stop_str
            elif not out.finished:
                visible_end -= stop_holdback(sample.full_text, params.stop)
        out.text = sample.full_text[: max(visible_end, len(out.text))]

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
