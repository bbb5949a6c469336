"""The fused scenario: the decoder's non-attention ops (`kernels.triton_fused`) against the torch
reference and the model's unfused torch code."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.plans import LayerShape
from pagedserve.kernels import reference

FUSED_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")
# The fused ops round where the reference rounds: an intermediate one ulp off (silu, the
# normalised x) is at most two ulps after the product with up or the weight. Relative to the
# dtype's epsilon (float32: 1e-5, for the GPU's approximate exp and rsqrt).
FUSED_ATOL = 1e-5
FUSED_RTOL = {torch.bfloat16: 2 * 2**-7, torch.float16: 2 * 2**-10, torch.float32: 1e-5}
ROPE_THETA = 500000.0  # Llama 3


def fused_label(layer: LayerShape, op: str, num_tokens: int) -> harness.Record:
    """Fields that name a fused-op case in every record about it."""
    return harness.case_record(
        "fused", f"{op} n{num_tokens}", layer.heads,
        op=op, num_tokens=num_tokens, hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
    )  # fmt: skip


@dataclass
class FusedCase:
    """One fused op three ways, each a call that returns the tensors the op produces: the kernel
    under test, the torch reference and the unfused torch code the model ran before the fused
    ops. Each call starts from inputs of its own, so the in-place updates of one do not feed
    another."""

    bytes_moved: int  # inputs read once + outputs written once
    call: Callable[[], tuple[torch.Tensor, ...]]
    ref: Callable[[], tuple[torch.Tensor, ...]]
    model: Callable[[], tuple[torch.Tensor, ...]]


def rope_tables(
    head_dim: int, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """cos and sin [max_positions, head_dim] float32 in the "rotate half" layout of
    engine/models/rotary.py (plain RoPE; scaling only changes the values)."""
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    freqs = torch.arange(max_positions, device=device).float()[:, None] / ROPE_THETA**exponents
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def build_fused_case(
    setup: harness.Setup, layer: LayerShape, op: str, num_tokens: int
) -> FusedCase:
    fused, device, dtype = setup.fused_kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    size = torch.finfo(dtype).bits // 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    n, hidden, eps = num_tokens, layer.hidden_size, 1e-5
    if op in ("rms_norm", "fused_add_rms_norm"):
        x, weight = randn(n, hidden), randn(hidden)
        if op == "rms_norm":
            return FusedCase(
                (2 * n * hidden + hidden) * size,
                lambda: (fused.rms_norm(x, weight, eps),),
                lambda: (reference.rms_norm(x, weight, eps),),
                lambda: (reference.rms_norm(x, weight, eps),),  # the model's RMSNorm math
            )
        residuals = [randn(n, hidden)]
        residuals += [residuals[0].clone() for _ in range(2)]

        def model_add_norm() -> tuple[torch.Tensor, ...]:
            # DecoderLayer: x = residual + sublayer output (a new tensor), then the next norm.
            total = residuals[2] + x
            return reference.rms_norm(total, weight, eps), total

        return FusedCase(
            (4 * n * hidden + hidden) * size,
            lambda: fused.fused_add_rms_norm(x, residuals[0], weight, eps),
            lambda: reference.fused_add_rms_norm(x, residuals[1], weight, eps),
            model_add_norm,
        )
    if op == "silu_and_mul":
        gate_up = randn(n, 2 * layer.intermediate_size)
        return FusedCase(
            3 * n * layer.intermediate_size * size,
            lambda: (fused.silu_and_mul(gate_up),),
            lambda: (reference.silu_and_mul(gate_up),),
            lambda: (reference.silu_and_mul(gate_up),),  # the model's MLP math
        )
    heads = layer.heads
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    qkv = randn(n, (hq + 2 * hkv) * d)
    positions = torch.randint(0, layer.max_positions, (n,), generator=gen, device=device)
    cos_table, sin_table = rope_tables(d, layer.max_positions, device)
    num_blocks = math.ceil(n / harness.BLOCK_SIZE)
    slot_mapping = torch.randperm(num_blocks * harness.BLOCK_SIZE, generator=gen, device=device)[:n]
    cache_shape = (num_blocks, harness.BLOCK_SIZE, hkv, d)
    caches = [torch.zeros(cache_shape, device=device, dtype=dtype) for _ in range(6)]
    # The model looks cos/sin up once per step for all its layers: not part of a layer's cost.
    cos = cos_table[positions].to(dtype).unsqueeze(1)
    sin = sin_table[positions].to(dtype).unsqueeze(1)

    def rotary(ops: ModuleType, k_cache: torch.Tensor, v_cache: torch.Tensor):
        q = ops.rotary_and_cache(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping, hq, hkv, d
        )
        return q, k_cache, v_cache

    def model() -> tuple[torch.Tensor, ...]:
        # engine/models/model.py Attention.forward up to attention, with engine/models/rotary.py
        # apply_rotary.
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        rotated = torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), dim=-1)
        q, k = rotated.mul_(sin).addcmul_(qk, cos).split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        setup.kernels.reshape_and_cache(k, v, caches[4], caches[5], slot_mapping)
        return q, caches[4], caches[5]

    return FusedCase(
        n * (2 * (hq + 2 * hkv) * d * size + 2 * d * 4 + 2 * 8),  # + cos/sin rows, indices
        lambda: rotary(fused, caches[0], caches[1]),
        lambda: rotary(reference, caches[2], caches[3]),
        model,
    )


def run_fused(
    report: harness.Report, setup: harness.Setup, layer: LayerShape, op: str, num_tokens: int
) -> None:
    """Check (to FUSED_RTOL), then time, one fused op against its reference and the model's
    unfused code."""
    label = fused_label(layer, op, num_tokens)
    device = setup.device
    case = build_fused_case(setup, layer, op, num_tokens)
    got, want, model_out = case.call(), case.ref(), case.model()
    rtol = FUSED_RTOL[setup.dtype]
    harness.check(report, label, zip(got, want, strict=True), atol=FUSED_ATOL, rtol=rtol)
    model_errs = [harness.max_abs_err(a, b) for a, b in zip(model_out, want, strict=True)]
    model_err = None if None in model_errs else max(model_errs)
    del got, want, model_out
    t, t_ref, t_model = (harness.time_us(fn, device) for fn in (case.call, case.ref, case.model))
    moved = case.bytes_moved
    report.emit(
        {"kind": "fused", **label, "bytes": moved}
        | {"time_us": round(t, 2), "gbps": harness.significant(moved / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": harness.significant(moved / t_ref / 1e3)}
        | {
            "model_time_us": round(t_model, 2),
            "model_gbps": harness.significant(moved / t_model / 1e3),
        }
        | {"model_ratio": harness.significant(t_model / t), "model_max_abs_err": model_err}
        | harness.speed_fields(t, t_ref, None)
    )
