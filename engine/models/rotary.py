"""Rotary position embeddings (RoPE), with linear, Llama-3 and Phi-3 LongRoPE frequency scaling.

The layout is the Hugging Face "rotate half" one: a head vector [x0 .. x(D/2-1) | x(D/2) .. x(D-1)]
is rotated pairwise as (x_i, x_{i+D/2}). GGUF files store Q/K rows permuted for llama.cpp's
interleaved layout; the GGUF loader undoes that so this module only ever sees HF order.
"""

from __future__ import annotations

import math

import torch

from pagedserve.engine.models.model_config import ROPE_SCALING_KEYS


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with optional linear, Llama-3 or LongRoPE
    scaling (`scaling` is a config's rope_scaling dict, or None for plain RoPE).

    LongRoPE divides each frequency by its own factor: `long_factor` when the engine serves
    contexts past `original_max_position_embeddings` (`max_positions`, the engine's longest
    context, is larger), `short_factor` otherwise. transformers switches per forward pass, by
    the longest sequence in it; one table for the engine's whole life is what a paged cache can
    hold (every cached key was rotated by it), and it equals transformers for every sequence
    when max_positions <= original_max_position_embeddings.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling and scaling["rope_type"] == "longrope":
        long = (
            max_positions is not None
            and max_positions > scaling["original_max_position_embeddings"]
        )
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        return 1.0 / (factors.float() * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    rope_type = scaling["rope_type"]
    assert rope_type in ROPE_SCALING_KEYS, f"ModelConfig let rope_type {rope_type!r} through"
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (given, or
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) as transformers computes it), 1
    for every other kind."""
    if not scaling or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths (low frequencies) are divided by `factor`, short ones are kept,
    # and the band in between is interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] (float32), applied by position index."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
        self.max_positions = max_positions

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, [N, 1, D] in `dtype`, as `apply_rotary` takes them (the
        model itself passes the whole tables to the backend's `rotary_and_cache`)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [N, H, D] by the angles of their token's position: x * cos + rot(x) * sin
    with rot([x1 | x2]) = [-x2 | x1]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    rotated.mul_(sin)
    return rotated.addcmul_(x, cos)
