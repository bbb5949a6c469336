"""Turns a SchedulerOutput into model inputs, runs the model and samples.

The runner owns the model and the KV-cache tensors; it never decides what runs (the scheduler
does) and never mutates requests (update_from_output does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve import kernels
from pagedserve.engine.lora.slots import LoRAManager
from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.model import CausalLM, KVCache
from pagedserve.engine.models.parallel import TPGroup
from pagedserve.engine.models.whisper import cross_metadata
from pagedserve.engine.structured_output import ALL_ALLOWED, StructuredOutputManager, bitmask_words
from pagedserve.engine.worker.cuda_graph import DecodeGraphs
from pagedserve.engine.worker.input_batch import Batch, InputBatch
from pagedserve.engine.worker.sampler import (
    DeviceSample,
    LogprobTensors,
    Sampler,
    SamplingRow,
    TokenLogprobs,
    to_device,
)
from pagedserve.kernels.backend import KernelBackend
from pagedserve.scheduler import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from pagedserve.scheduler.utils import cdiv


@dataclass(frozen=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]]
    # Per request that scored prompt tokens this step: (prompt position of the first entry, one
    # entry per prompt position from there on).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Requests whose logits held a NaN or an infinity; their entry in sampled_token_ids is a
    # placeholder (see Sampler.sample).
    nonfinite_request_ids: list[str] = field(default_factory=list)
    # Requests that had drafts: the drafts the model agreed with, then its own next token
    # (sampled_token_ids holds the first of these).
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # An embedding model (engine/worker/pooler.py): each request's pooled vector.
    pooled: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs] rows of the hidden states to sample from
    # Rows scored for prompt logprobs, each asking sequence's in batch order (empty when nobody
    # asked: lm_head then runs on sampled rows only).
    prompt_logprob_indices: torch.Tensor  # [num_prompt_logprob_rows]
    # Placeholder tokens: input_ids[fill_dst] = the previous step's sampled ids[fill_src].
    fill_dst: torch.Tensor
    fill_src: torch.Tensor


def to_model_inputs(batch: Batch, device: torch.device) -> ModelInputs:
    """Send a step's host arrays to `device` with non-blocking copies from pinned memory (no host
    sync)."""
    qsl = batch.query_start_loc
    logits_indices = qsl[1:][batch.sample].astype(np.int64) - 1
    drafts = batch.num_drafts[batch.sample]
    if drafts.any():  # a sequence with d drafts samples at its last d + 1 positions
        logits_indices = np.concatenate(
            [np.arange(last - d, last + 1) for last, d in zip(logits_indices, drafts, strict=True)]
        )
    prompt_rows = [qsl[i] + np.arange(len(t)) for i, t in batch.prompt_logprob_targets]
    prompt_logprob_indices = (
        np.concatenate(prompt_rows).astype(np.int64) if prompt_rows else np.empty(0, np.int64)
    )
    meta = AttentionMetadata(
        slot_mapping=_send(batch.slot_mapping, device),
        block_tables=_send(batch.block_tables, device),
        seq_lens=_send(batch.seq_lens, device),
        query_start_loc=_send(qsl, device),
    )
    return ModelInputs(
        input_ids=_send(batch.input_ids, device),
        positions=_send(batch.positions, device),
        meta=meta,
        logits_indices=_send(logits_indices, device),
        prompt_logprob_indices=_send(prompt_logprob_indices, device),
        fill_dst=_send(batch.fill_dst, device),
        fill_src=_send(batch.fill_src, device),
    )


def _send(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # Always a fresh copy, whose strides are row-major on every dim: numpy calls an array
    # contiguous whatever its size-1 dims' strides (np.ascontiguousarray left a lone one-block
    # request's transposed [G, 1, 1] block tables as they were, entries G apart), and the
    # compiled attention kernel takes dense rows. A step's arrays are small.
    tensor = torch.from_numpy(np.array(array, order="C"))
    return to_device(tensor, tensor.dtype, device)


@dataclass
class _DeviceResult:
    sample: DeviceSample | None  # None when only partial prefill chunks ran
    prompt_logprobs: LogprobTensors | None


class StepHandle:
    """A launched step. Its device work may still be running (queued on the GPU); `result()`
    waits for it once, stores the sampled ids in the persistent batch and returns them."""

    def __init__(
        self,
        runner: ModelRunner | None,
        batch: Batch | None = None,
        device: _DeviceResult | None = None,
        output: RunnerOutput | None = None,
        drafts: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self._runner = runner
        self._batch = batch
        self.drafts = drafts or {}  # the step's draft tokens, by request
        self.device = device  # the step's results as device tensors (the next step reads ids)
        self._output = output
        self._host: _DeviceResult | None = device  # on CUDA: copies being made to the host
        self._copied: torch.cuda.Event | None = None
        if batch is not None:
            sample_idx = batch.sample_indices
            self.sample_rows = batch.rows[sample_idx]
            self.serials = runner.input_batch.serial[self.sample_rows]
            self.num_drafts = batch.num_drafts[sample_idx]
            self.positions = batch.ends[sample_idx] - self.num_drafts
            self.sample_ids = [batch.request_ids[i] for i in sample_idx]
            if runner.device.type == "cuda":
                # Pinned memory and an event: result() then waits for this step only, not for
                # steps launched after it.
                copy = _copy_to_host
                self._host = _DeviceResult(
                    None if device.sample is None else device.sample.map(copy),
                    None if device.prompt_logprobs is None else device.prompt_logprobs.map(copy),
                )
                self._copied = torch.cuda.Event()
                self._copied.record()

    @property
    def done(self) -> bool:
        return self._output is not None

    def result(self) -> RunnerOutput:
        if self._output is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._output = self._runner._finish(self._batch, self._host, self)
        return self._output


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes for copies and fills: an fp8 cache as uint8 (torch's CPU index ops do
    not take float8 types; a byte copy is the same copy)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", non_blocking=True)


class ModelRunner:
    """Runs the steps the scheduler plans, on the persistent batch (engine/worker/input_batch.py).

    `graphs`, when set, runs the decode steps that fit it (see engine/worker/cuda_graph.py); every
    other step runs the model eagerly.

    `launch(out)` prepares the step and starts its device work; the returned handle's `result()`
    brings the sampled ids back. A step launched before the previous one's result was read
    takes the previous step's sampled ids on the device for its placeholder tokens.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        seed: int = 0,
        graphs: DecodeGraphs | None = None,
        ops: KernelBackend = kernels,
        windows: tuple[int | None, ...] = (None,),
        num_host_blocks: int = 0,
        tp: TPGroup | None = None,
        suppress: tuple[Sequence[int], Sequence[int]] = ((), ()),
    ) -> None:
        self.model = model
        # Tensor parallel: every rank runs the same steps; rank 0 (the driver) samples and
        # broadcasts the ids, which the other ranks record as their inputs.
        self.tp = tp
        self.samples = tp is None or tp.is_driver
        self.kv_caches = kv_caches
        self.ops = ops  # the kernels' backend (kernels.reference or kernels.triton_ops)
        # Each tensor once: the layers of different KV-cache groups share theirs.
        self._all_caches = list({id(c): c for pair in kv_caches for c in pair}.values())
        # Swap preemption's host pool: one tensor per device cache tensor, num_host_blocks
        # blocks each (pinned on CUDA, so the copies run at full bus speed).
        pin = device.type == "cuda"
        self.host_caches = (
            [
                torch.zeros((num_host_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
                for c in self._all_caches
            ]
            if num_host_blocks
            else []
        )
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed)
        self.graphs = graphs
        self.input_batch = InputBatch(
            max_num_seqs, max_model_len, cdiv(max_model_len, block_size), windows
        )
        self._last: StepHandle | None = None  # the last launched step that sampled
        # The engine core's grammars (structured outputs), when it has any: each step masks
        # the logits of the constrained rows with their matchers' allowed tokens. The core
        # steps synchronously while any is live, so every matcher has seen its last token.
        self.structured: StructuredOutputManager | None = None
        # An encoder-decoder (Whisper): each running request's cross-attention blocks, and the
        # allowed-token bitmasks of its generation config's suppressed tokens (a request's first
        # token, then the others), None when it suppresses nothing.
        self.encoder_tables: dict[str, tuple[int, ...]] = {}
        self._suppress_masks = suppression_masks(*suppress, model.config.vocab_size)
        self.pooler = None  # an embedding model's (engine/worker/pooler.py): it pools, no sampling
        self.lora: LoRAManager | None = None  # the adapters' slots, when the engine serves them

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step to completion."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Apply the scheduler's increments, prepare the step and start it."""
        state = self.input_batch
        state.apply(out)
        if self.model.is_encoder_decoder:
            self._encode(out)
        # Swap-outs first: this step may write into the device blocks they leave.
        if out.swap_out:
            self._swap(out.swap_out, self._all_caches, self.host_caches)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.swap_in:
            self._swap(out.swap_in, self.host_caches, self._all_caches)
        if not out.num_scheduled_tokens:
            return StepHandle(None, output=RunnerOutput({}, {}))
        rows = state.rows_of(out)
        previous = self._last
        if (
            previous is not None
            and not previous.done
            and state.history_rows
            and not state.history_rows.isdisjoint(rows.tolist())
        ):
            previous.result()  # penalties read the whole history on the host: wait for it
        batch = state.prepare(out, rows, self.block_size)
        if self.lora is not None:
            self._set_loras(batch)
        if self.pooler is not None:
            return self.pooler.run(self, batch)
        sampling_rows = self._sampling_rows(batch)
        plan = (
            self.sampler.plan(
                sampling_rows, self.device, self._allowed_tokens(batch, out, sampling_rows)
            )
            if sampling_rows and self.samples
            else None
        )
        prompt_targets = batch.prompt_logprob_targets
        prompt_ks = [
            self.input_batch.params[int(batch.rows[i])].prompt_logprobs or 0
            for i, targets in prompt_targets
            for _ in range(len(targets))
        ]
        inputs = to_model_inputs(batch, self.device)
        if self.encoder_tables:
            inputs = self._with_cross_attention(inputs, batch)
        prompt_target_ids = (
            _send(np.concatenate([t for _, t in prompt_targets]), self.device)
            if prompt_targets
            else None
        )

        # On CUDA everything below queues kernels: nothing waits for the device.
        if inputs.fill_dst.numel():
            sampled = previous.device.sample.token_ids
            inputs.input_ids[inputs.fill_dst] = sampled[inputs.fill_src]
        hidden = self._forward(inputs)
        prompt_logprobs = None
        if prompt_target_ids is not None:
            logits = self.model.compute_logits(hidden[inputs.prompt_logprob_indices])
            if self.samples:
                prompt_logprobs = LogprobTensors.compute(logits, prompt_target_ids, prompt_ks)
        sample = None
        if sampling_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            if self.samples:
                sample = self.sampler.sample(logits, plan)
            if self.tp is not None:
                sample = self._share_sample(sample, len(sampling_rows))
        handle = StepHandle(
            self, batch, _DeviceResult(sample, prompt_logprobs), drafts=out.spec_token_ids
        )
        if sampling_rows:
            self._last = handle
        return handle

    def _set_loras(self, batch: Batch) -> None:
        """Each token's adapter slot for the layers (adapters copied into slots as needed)."""
        state = self.input_batch
        if not state.lora_rows:
            self.lora.step.clear()
            return
        loras = [state.loras[row] for row in batch.rows.tolist()]
        self.lora.set_step(loras, np.diff(batch.query_start_loc))

    def _share_sample(self, sample: DeviceSample | None, num_rows: int) -> DeviceSample:
        """Tensor parallel: rank 0's sampled ids reach every rank (on the device, so the next
        step's placeholders fill from them as rank 0's do); the other ranks' samples carry no
        logprobs and are finite (rank 0 fails a non-finite row and has its blocks cleared)."""
        if sample is not None:
            self.tp.broadcast(sample.token_ids)
            return sample
        ids = torch.empty(num_rows, dtype=torch.long, device=self.device)
        self.tp.broadcast(ids)
        finite = torch.ones(num_rows, dtype=torch.bool, device=self.device)
        return DeviceSample(ids, finite, [], None)

    def _finish(self, batch: Batch, host: _DeviceResult, handle: StepHandle) -> RunnerOutput:
        """A step's results on the host: record the sampled ids in the batch, key by request."""
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        if host.prompt_logprobs is not None:
            entries = host.prompt_logprobs.to_host()
            offset = 0
            for i, targets in batch.prompt_logprob_targets:
                first = int(batch.positions[batch.query_start_loc[i]]) + 1
                prompt_logprobs[batch.request_ids[i]] = (
                    first,
                    entries[offset : offset + len(targets)],
                )
                offset += len(targets)
        if host.sample is None:
            return RunnerOutput({}, {}, prompt_logprobs)
        result = host.sample.to_host()
        ids = handle.sample_ids
        token_ids, row_logprobs, owners = result.token_ids, result.logprobs, ids
        accepted: dict[str, list[int]] = {}
        if handle.num_drafts.any():
            token_ids, row_logprobs, owners, accepted = self._verify(handle, result)
        self.input_batch.record(
            handle.sample_rows,
            handle.serials,
            handle.positions,
            np.asarray(token_ids, dtype=np.int64),
        )
        for j, request_id in enumerate(ids):
            if request_id in accepted:
                tokens = accepted[request_id]
                num_rejected = int(handle.num_drafts[j]) - (len(tokens) - 1)
                self.input_batch.accept(int(handle.sample_rows[j]), tokens[1:], num_rejected)
        sampled = dict(zip(ids, token_ids, strict=True))
        logprobs = {rid: lp for rid, lp in zip(ids, row_logprobs, strict=True) if lp is not None}
        nonfinite = list(dict.fromkeys(owners[i] for i in result.nonfinite_rows))
        return RunnerOutput(sampled, logprobs, prompt_logprobs, nonfinite, accepted)

    @staticmethod
    def _verify(handle: StepHandle, result) -> tuple[list, list, list[str], dict[str, list[int]]]:
        """Speculative decoding: a sequence with drafts d_1..d_k sampled t_0..t_k at its last
        k + 1 positions, each from its own distribution (t_j follows d_j, t_0 its last token).
        The drafts are accepted while t_{j-1} == d_j; the first disagreeing t (or t_k when all
        agree) is the model's own next token (Scheduler._propose says why that keeps the
        distribution). Returns each sequence's first token and
        logprobs, the owner of every sampled row, and the accepted tokens of those with drafts."""
        firsts, first_logprobs, owners = [], [], []
        accepted: dict[str, list[int]] = {}
        row = 0
        all_drafts = handle.num_drafts.tolist()
        for request_id, num_drafts in zip(handle.sample_ids, all_drafts, strict=True):
            tokens = result.token_ids[row : row + num_drafts + 1]
            firsts.append(tokens[0])
            first_logprobs.append(result.logprobs[row])
            owners += [request_id] * (num_drafts + 1)
            if num_drafts:
                drafts = handle.drafts[request_id]
                num_accepted = 0
                while num_accepted < num_drafts and tokens[num_accepted] == drafts[num_accepted]:
                    num_accepted += 1
                accepted[request_id] = tokens[: num_accepted + 1]
            row += num_drafts + 1
        return firsts, first_logprobs, owners, accepted

    def _copy_blocks(self, copies: tuple[tuple[str, int, int, int], ...]) -> None:
        """Copy-on-write: each shared block into the block replacing it, in every layer, before
        the step writes into the copy (one kernel launch with the Triton backend)."""
        src = to_device([copy[2] for copy in copies], torch.long, self.device)
        dst = to_device([copy[3] for copy in copies], torch.long, self.device)
        self.ops.copy_blocks(self._all_caches, src, dst)

    @staticmethod
    def _swap(
        pairs: tuple[tuple[int, int], ...], sources: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> None:
        """Copy block pairs[i][0] of each source tensor into block pairs[i][1] of its target
        (swap preemption, between the device and the host pool), every layer. On CUDA a swap-out
        waits for the steps queued before it (a blocking copy: the host reads its result at
        once); a swap-in is queued ahead of the step's kernels."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        src, dst = src.to(sources[0].device), dst.to(targets[0].device)
        to_device = targets[0].device.type != "cpu"
        for source, target in zip(sources, targets, strict=True):
            blocks = _raw(source).index_select(0, src).to(target.device, non_blocking=to_device)
            _raw(target).index_copy_(0, dst, blocks)

    @torch.inference_mode()
    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero these KV blocks in every layer: attention reads whole blocks and masks their
        unused tail, but a NaN left there would still poison the weighted sum."""
        if not block_ids:
            return
        index = to_device(block_ids, torch.long, self.device)
        for cache in self._all_caches:
            _raw(cache).index_fill_(0, index, 0)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        num_tokens = inputs.input_ids.shape[0]
        _, num_seqs, width = inputs.meta.block_tables.shape
        if self.graphs is not None and self.graphs.can_run(num_tokens, num_seqs, width):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _encode(self, out: SchedulerOutput) -> None:
        """Keep the running requests' cross-attention tables, and run the encoder for those
        the scheduler gave new encoder blocks, writing their cross-attention K/V."""
        for request_id in (*out.finished_request_ids, *out.preempted_request_ids):
            self.encoder_tables.pop(request_id, None)
        encode = []
        for new in out.new_requests:
            self.encoder_tables[new.request_id] = new.encoder_block_ids
            if new.encoder_input is not None:
                encode.append(new)
        if encode:
            self.model.encode_into_cache(
                [new.encoder_input for new in encode],
                [new.encoder_block_ids for new in encode],
                self.kv_caches,
                self.block_size,
            )

    def _with_cross_attention(self, inputs: ModelInputs, batch: Batch) -> ModelInputs:
        """The step's inputs with its cross-attention view: each token reads its request's
        encoder blocks (engine/models/whisper.py `cross_metadata`)."""
        tables = np.array([self.encoder_tables[rid] for rid in batch.request_ids], np.int32)
        per_token = np.repeat(tables, np.diff(batch.query_start_loc), axis=0)
        cross = cross_metadata(per_token, self.model.config.max_source_positions)
        on_device = AttentionMetadata(
            to_device(cross.slot_mapping, torch.int64, self.device),
            to_device(cross.block_tables, torch.int32, self.device),
            to_device(cross.seq_lens, torch.int32, self.device),
            to_device(cross.query_start_loc, torch.int32, self.device),
        )
        return dataclasses.replace(inputs, meta=dataclasses.replace(inputs.meta, cross=on_device))

    def _allowed_tokens(
        self, batch: Batch, out: SchedulerOutput, sampling_rows: list[SamplingRow]
    ) -> tuple[list[int], np.ndarray] | None:
        """(sampling rows under a grammar or a suppression, the allowed tokens' bitmasks of all
        sampling rows), in the order of `_sampling_rows` (a sequence with d drafts has d + 1
        rows); None when no row is constrained."""
        if self._suppress_masks is not None:
            first, later = self._suppress_masks
            is_first = np.array([row.num_output_tokens == 0 for row in sampling_rows])
            return list(range(len(sampling_rows))), np.where(is_first[:, None], first, later)
        structured = self.structured
        if structured is None or not structured.matchers:
            return None
        sample_idx = batch.sample_indices
        num_drafts = batch.num_drafts[sample_idx].tolist()
        masks = np.full(
            (len(num_drafts) + sum(num_drafts), bitmask_words(structured.vocab_size)),
            ALL_ALLOWED,
            dtype=np.int32,
        )
        rows: list[int] = []
        first = 0
        for i, d in zip(sample_idx.tolist(), num_drafts, strict=True):
            request_id = batch.request_ids[i]
            if request_id in structured.matchers:
                drafts = out.spec_token_ids.get(request_id, ())[:d]
                structured.fill(request_id, drafts, masks[first : first + d + 1])
                rows += range(first, first + d + 1)
            first += d + 1
        return (rows, masks) if rows else None

    def _sampling_rows(self, batch: Batch) -> list[SamplingRow]:
        """What the sampler needs of each sampling sequence, in batch order; the token history
        only for rows with penalties."""
        state = self.input_batch
        sample_idx = batch.sample_indices
        rows = batch.rows[sample_idx].tolist()
        num_drafts = batch.num_drafts[sample_idx]
        first_positions = batch.ends[sample_idx] - num_drafts
        num_outputs = (first_positions - state.num_prompt[batch.rows[sample_idx]]).tolist()
        params = state.params
        sampling = [SamplingRow(params[row], n) for row, n in zip(rows, num_outputs, strict=True)]
        if state.history_rows:
            for i, row in enumerate(rows):
                if row not in state.history_rows:
                    continue
                want_prompt, want_output = params[row].needs_history
                prompt_ids, output_ids = state.history(row, int(batch.ends[sample_idx[i]]))
                sampling[i] = SamplingRow(
                    params[row],
                    num_outputs[i],
                    prompt_token_ids=prompt_ids if want_prompt else None,
                    output_token_ids=output_ids if want_output else None,
                )
        if num_drafts.any():
            # A sequence with d drafts samples its positions n .. n + d (the k-th output token
            # draws the k-th number of a seed). Requests with penalties get no drafts
            # (Scheduler._propose), so these rows need no history.
            sampling = [
                row if d == 0 else SamplingRow(row.params, row.num_output_tokens + j)
                for row, d in zip(sampling, num_drafts.tolist(), strict=True)
                for j in range(d + 1)
            ]
        return sampling


def suppression_masks(
    never: Sequence[int], never_first: Sequence[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Allowed-token bitmasks ([words] int32 each) of a first token (neither `never` nor
    `never_first`) and of the later ones (not `never`); None when both are empty."""
    if not never and not never_first:
        return None
    words = bitmask_words(vocab_size)

    def mask(banned: Sequence[int]) -> np.ndarray:  # bit i % 32 of word i // 32: token i
        bits = np.ones(words * 32, dtype=bool)
        bits[list(banned)] = False
        return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)

    return mask([*never, *never_first]), mask(never)


def profile_step(
    num_tokens: int,
    max_num_seqs: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
    num_groups: int = 1,
) -> SchedulerOutput:
    """The largest step the scheduler can hand the runner: `num_tokens` prompt tokens spread over
    as many sequences as may sample (each sampling with top-k and top-p, the sampler's costliest
    path), on consecutive blocks from 0 (each of `num_groups` KV-cache groups with blocks of
    its own). Run once at start-up to measure peak GPU memory."""
    num_seqs = max(min(max_num_seqs, num_tokens), cdiv(num_tokens, max_model_len - 1))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    new_requests = []
    next_block = 0
    for i in range(num_seqs):
        length = num_tokens // num_seqs + (i < num_tokens % num_seqs)
        num_blocks = cdiv(length, block_size) * num_groups
        new_requests.append(
            NewRequestData(
                request_id=f"profile-{i}",
                token_ids=tuple((7 * j + i) % vocab_size for j in range(length)),
                num_prompt_tokens=length,
                block_ids=tuple(range(next_block, next_block + num_blocks)),
                num_computed_tokens=0,
                sampling_params=params,
            )
        )
        next_block += num_blocks
    return SchedulerOutput(
        step_id=1,
        new_requests=tuple(new_requests),
        cached_requests=CachedRequestData(),
        num_scheduled_tokens={new.request_id: len(new.token_ids) for new in new_requests},
        total_num_scheduled_tokens=num_tokens,
        preempted_request_ids=(),
        finished_request_ids=(),
    )
