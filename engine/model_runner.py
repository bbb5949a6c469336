"""Turns a SchedulerOutput into model inputs, runs the model and samples.

The runner owns the model and the KV-cache tensors; it never decides what runs (the scheduler
does) and never mutates requests (update_from_output does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention_metadata import AttentionMetadata
from engine.cuda_graph import DecodeGraphs
from engine.model import KVCache, LlamaForCausalLM
from engine.sampler import (
    Sampler,
    SamplingRow,
    TokenLogprobs,
    needs_history,
    to_device,
    token_logprobs,
)
from scheduler import Request, SamplingParams, ScheduledRequest, SchedulerOutput
from scheduler.utils import cdiv


@dataclass(frozen=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]]
    # Per request that scored prompt tokens this step (ScheduledRequest.prompt_logprob_token_ids):
    # (prompt position of the first entry, one entry per prompt position from there on).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_seqs] rows of the hidden states to sample from
    sampling_request_ids: list[str]
    # Rows scored for prompt logprobs: each asking request's first len(prompt_logprob_token_ids)
    # rows, in scheduling order (empty when nobody asked: lm_head then runs on sampled rows only).
    prompt_logprob_indices: torch.Tensor  # [num_prompt_logprob_rows]


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """Flatten the scheduled chunks into one token batch, built on the host and sent to
    `device` with non-blocking copies from pinned memory (no host sync).

    seq i: token_ids[i] at positions start_i .. start_i + len_i - 1
    query_start_loc = cumsum([0, len_0, len_1, ...]); seq_lens_i = start_i + len_i
    slot(token) = block_table[pos // block_size] * block_size + pos % block_size
    """
    # numpy for the index arithmetic: on small host arrays its per-op overhead is far below
    # torch's CPU ops (BENCHMARKS.md, "Host time of a decode step").
    scheduled = out.scheduled
    num_seqs = len(scheduled)
    q_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_seqs)
    starts = np.fromiter((s.start_position for s in scheduled), np.int64, num_seqs)
    max_blocks = max(len(s.block_table) for s in scheduled)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for i, s in enumerate(scheduled):
        block_tables[i, : len(s.block_table)] = s.block_table
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_seqs:  # decode: one token per sequence
        input_ids = np.fromiter((s.token_ids[0] for s in scheduled), np.int64, num_seqs)
        positions = starts
        pos_blocks = block_tables[np.arange(num_seqs), positions // block_size]
    else:
        input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), np.int64, num_tokens)
        seq_idx = np.repeat(np.arange(num_seqs), q_lens)
        positions = starts[seq_idx] + (np.arange(num_tokens) - query_start_loc[seq_idx])
        pos_blocks = block_tables[seq_idx, positions // block_size]
    slot_mapping = pos_blocks.astype(np.int64) * block_size + positions % block_size
    seq_lens = (starts + q_lens).astype(np.int32)
    sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
    logits_indices = query_start_loc[1:][sample_rows] - 1
    prompt_rows = [
        query_start_loc[i] + np.arange(len(s.prompt_logprob_token_ids))
        for i, s in enumerate(scheduled)
        if s.prompt_logprob_token_ids
    ]
    prompt_logprob_indices = (
        np.concatenate(prompt_rows) if prompt_rows else np.empty(0, dtype=np.int64)
    )
    meta = AttentionMetadata(
        slot_mapping=_send(slot_mapping, device),
        block_tables=_send(block_tables, device),
        seq_lens=_send(seq_lens, device),
        query_start_loc=_send(query_start_loc.astype(np.int32), device),
    )
    return ModelInputs(
        input_ids=_send(input_ids, device),
        positions=_send(positions, device),
        meta=meta,
        logits_indices=_send(logits_indices, device),
        sampling_request_ids=[scheduled[i].request_id for i in sample_rows],
        prompt_logprob_indices=_send(prompt_logprob_indices, device),
    )


def _send(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return to_device(tensor, tensor.dtype, device)


class ModelRunner:
    """`graphs`, when set, runs the decode steps that fit it (see engine/cuda_graph.py); every
    other step runs the model eagerly."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed)
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        if not out.scheduled:
            return RunnerOutput({}, {})
        inputs = prepare_inputs(out, self.block_size, self.device)
        hidden = self._forward(inputs)
        prompt_logprobs = self._prompt_logprobs(out, hidden, inputs.prompt_logprob_indices)
        if not inputs.sampling_request_ids:
            return RunnerOutput({}, {}, prompt_logprobs)  # only partial prefill chunks this step
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        by_id = {s.request_id: s for s in out.scheduled}
        rows = [_sampling_row(by_id[rid], requests.get(rid)) for rid in inputs.sampling_request_ids]
        result = self.sampler(logits, rows)
        ids = inputs.sampling_request_ids
        sampled = dict(zip(ids, result.token_ids, strict=True))
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs, strict=True) if lp is not None}
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        num_tokens = inputs.input_ids.shape[0]
        num_seqs, width = inputs.meta.block_tables.shape
        if self.graphs is not None and self.graphs.can_run(num_tokens, num_seqs, width):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor, indices: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Score the prompt tokens the scheduler asked for, one lm_head over just their rows."""
        asking = [s for s in out.scheduled if s.prompt_logprob_token_ids]
        if not asking:
            return {}
        logits = self.model.compute_logits(hidden[indices])
        target_ids = [t for s in asking for t in s.prompt_logprob_token_ids]
        ks = [
            s.sampling_params.prompt_logprobs or 0
            for s in asking
            for _ in s.prompt_logprob_token_ids
        ]
        entries = token_logprobs(logits, torch.tensor(target_ids, device=logits.device), ks)
        result: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        offset = 0
        for s in asking:
            num = len(s.prompt_logprob_token_ids)
            result[s.request_id] = (s.start_position + 1, entries[offset : offset + num])
            offset += num
        return result


def _sampling_row(scheduled: ScheduledRequest, request: Request | None) -> SamplingRow:
    params = scheduled.sampling_params
    want_prompt, want_output = needs_history(params)
    if request is None or not (want_prompt or want_output):
        return SamplingRow(params, scheduled.num_output_tokens)
    return SamplingRow(
        params,
        scheduled.num_output_tokens,
        prompt_token_ids=request.prompt_token_ids if want_prompt else None,
        output_token_ids=list(request.output_token_ids) if want_output else None,
    )


def profile_step(
    num_tokens: int, max_num_seqs: int, block_size: int, max_model_len: int, vocab_size: int
) -> SchedulerOutput:
    """The largest step the scheduler can hand the runner: `num_tokens` prompt tokens spread over
    as many sequences as may sample (each sampling with top-k and top-p, the sampler's costliest
    path), on consecutive blocks from 0. Run once at start-up to measure peak GPU memory."""
    num_seqs = max(min(max_num_seqs, num_tokens), cdiv(num_tokens, max_model_len - 1))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    scheduled = []
    next_block = 0
    for i in range(num_seqs):
        length = num_tokens // num_seqs + (i < num_tokens % num_seqs)
        num_blocks = cdiv(length, block_size)
        scheduled.append(
            ScheduledRequest(
                request_id=f"profile-{i}",
                token_ids=tuple((7 * j + i) % vocab_size for j in range(length)),
                start_position=0,
                block_table=tuple(range(next_block, next_block + num_blocks)),
                sampling_params=params,
                sample=True,
                num_output_tokens=0,
            )
        )
        next_block += num_blocks
    return SchedulerOutput(
        scheduled=tuple(scheduled),
        num_scheduled_tokens=num_tokens,
        preempted_request_ids=(),
        finished_request_ids=(),
    )
