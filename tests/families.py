"""Tiny random checkpoints of each family pagedserve runs beyond Llama and Qwen2 (Qwen3, Gemma 2,
Gemma 3, Phi-3, Mixtral, Qwen3-MoE), built with transformers' own config and model classes; the
parity tests of tests/engine/test_model_families.py and test_gguf_families.py load them.

Every norm weight is drawn at random (Gemma's start at zero, which would hide a norm applied as
w instead of 1 + w), and the logits are peaked (initializer_range 0.1), so greedy choices are
not near-ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedserve.engine.models.model_config import FULL_ATTENTION, SLIDING_ATTENTION

WINDOW = 8
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)
LONGROPE = {
    "type": "longrope",
    "short_factor": [round(1.0 + 0.1 * i, 2) for i in range(8)],  # as configs write them
    "long_factor": [round(2.0 + 0.3 * i, 2) for i in range(8)],
}
# family -> (transformers config class, model class, config arguments beyond COMMON)
FAMILIES = {
    # Layer 1 slides, layer 0 does not (max_window_layers=1): Qwen's mixed layers.
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
             final_logit_softcapping=3.0),
    ),
    # Five sliding layers, then a global one; local and global RoPE differ, global scaled.
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(sliding_window=WINDOW, num_hidden_layers=6, query_pre_attn_scalar=24,
             rope_parameters={
                 FULL_ATTENTION: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                 SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 1000.0},
             }),
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        dict(pad_token_id=0, sliding_window=WINDOW, original_max_position_embeddings=64,
             rope_scaling=LONGROPE),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
}  # fmt: skip


def build_family(name: str, path: Path, **changes: Any):
    """Build family `name`'s tiny model (config arguments `changes` on top of FAMILIES'), save
    it to `path` with save_pretrained and return the transformers model (eval mode)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **changes})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


# What a GGUF file cannot say, taken out of the tiny models whose GGUF files the tests write
# (tests/engine/test_gguf_families.py): llama.cpp's converter drops the sliding window of Qwen
# and Mixtral (llama.cpp runs them without one), and Gemma's score scale is head_dim ** -0.5
# except in the 27B models (query_pre_attn_scalar is not stored).
GGUF_CHANGES: dict[str, dict[str, Any]] = {
    "qwen3": dict(use_sliding_window=False),
    "gemma2": dict(query_pre_attn_scalar=COMMON["head_dim"]),
    "gemma3": dict(query_pre_attn_scalar=COMMON["head_dim"]),
    "mixtral": dict(sliding_window=None),
}
