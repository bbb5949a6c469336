"""Per-step attention inputs, built by the model runner and passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens go in the paged KV cache and what each sequence attends to.

    For a step with sequences s0 (3 new tokens, 5 cached) and s1 (1 new token, 9 cached):

        query_start_loc = [0, 3, 4]     s_i's new tokens: q[query_start_loc[i]:query_start_loc[i+1]]
        seq_lens        = [8, 10]       cached + new tokens per sequence
        slot_mapping    = [slot(s0, 5), slot(s0, 6), slot(s0, 7), slot(s1, 9)]
        slot(s, p)      = block_tables[s][p // block_size] * block_size + p % block_size

    With several KV-cache groups (scheduler/kv_groups.py) each group has its own tables and
    slots: a layer of group g reads slot_mapping[g] and block_tables[g].
    """

    slot_mapping: torch.Tensor  # [num_groups, num_tokens] int64
    block_tables: torch.Tensor  # [num_groups, num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    # An encoder-decoder's cross-attention reads (engine/models/whisper.py `cross_metadata`).
    cross: AttentionMetadata | None = None
