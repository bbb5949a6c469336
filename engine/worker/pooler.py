"""Embeddings: a step's last hidden states pooled into one vector per sequence, instead of
sampling a token (`--task embed`, engine/models/bert_config.py `PoolingConfig`).

An embedding request's whole prompt runs in one step (the scheduler's `prefill_only`), so every
sequence of the step is whole and pools here; the runner reports a placeholder token 0 for it,
with which the scheduler finishes it (max_tokens 1), and its vector (`RunnerOutput.pooled`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.models.bert_config import PoolingConfig
from pagedserve.engine.worker.input_batch import Batch
from pagedserve.engine.worker.model_runner import (
    ModelRunner,
    RunnerOutput,
    StepHandle,
    to_model_inputs,
)


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], mode: str, normalize: bool) -> torch.Tensor:
    """[num_tokens, hidden] states of whole sequences of `seq_lens` tokens, packed one after
    the other -> [num_seqs, hidden] float32: each sequence's first token ("cls"), the mean of
    its tokens ("mean") or its last token ("last"), L2-normalised when asked (as
    sentence-transformers' Pooling and Normalize modules compute them)."""
    if mode == "mean":
        vectors = torch.stack([seq.mean(dim=0) for seq in hidden.split(list(seq_lens))])
    else:
        lens = torch.tensor(list(seq_lens), device=hidden.device)
        ends = lens.cumsum(0)
        vectors = hidden[ends - lens if mode == "cls" else ends - 1]
    vectors = vectors.float()
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors


class Pooler:
    """The runner's step for an embedding model (`ModelRunner.pooler`)."""

    def __init__(self, config: PoolingConfig) -> None:
        self.config = config

    def run(self, runner: ModelRunner, batch: Batch) -> StepHandle:
        qsl = batch.query_start_loc
        idx = batch.sample_indices
        # Every sequence of the step is whole (prefill_only) and ends with this chunk.
        assert len(idx) == len(batch.request_ids), "an embedding step has only whole prompts"
        inputs = to_model_inputs(batch, runner.device)
        hidden = runner._forward(inputs)
        vectors = pool(hidden, np.diff(qsl).tolist(), self.config.mode, self.config.normalize)
        host = vectors.cpu().numpy()
        ids = batch.request_ids
        pooled = {rid: host[i] for i, rid in enumerate(ids)}
        return StepHandle(None, output=RunnerOutput(dict.fromkeys(ids, 0), {}, pooled=pooled))
