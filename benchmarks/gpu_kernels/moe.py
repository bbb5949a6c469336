"""The moe scenario: the experts of a mixture-of-experts layer (`kernels.triton_moe.fused_moe`)
against the torch reference and the dense layer of the same active size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.plans import MoeShape
from pagedserve.kernels import reference


def moe_label(shape: MoeShape, num_tokens: int) -> harness.Record:
    """Fields that name a fused-MoE case in every record about it."""
    return {
        "scenario": "moe",
        "case": f"{shape.name} n{num_tokens}",
        "shape": shape.name,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "num_tokens": num_tokens,
    }


def run_moe(report: harness.Report, setup: harness.Setup, shape: MoeShape, num_tokens: int) -> None:
    """Check (to ATOL / RTOL), then time, the experts of one MoE layer for `num_tokens` tokens
    against the torch reference and the FLOP-equivalent dense layer."""
    label = moe_label(shape, num_tokens)
    moe, device, dtype = setup.moe_kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    h, i, e, k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        # Weights at 1 / sqrt(fan_in): activations stay O(1), as in a trained layer.
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x = randn(num_tokens, h)
    gate_up, down = randn(e, 2 * i, h, scale=h**-0.5), randn(e, h, i, scale=i**-0.5)
    logits = torch.randn(num_tokens, e, generator=gen, device=device)
    weights, ids = reference.moe_route(logits, k, shape.renormalize)
    dense_gate_up, dense_down = randn(2 * i * k, h, scale=h**-0.5), randn(h, i * k, scale=i**-0.5)

    def call() -> torch.Tensor:
        return moe.fused_moe(x, gate_up, down, weights, ids)

    def ref() -> torch.Tensor:
        return reference.fused_moe(x, gate_up, down, weights, ids)

    def dense() -> torch.Tensor:
        return F.linear(reference.silu_and_mul(F.linear(x, dense_gate_up)), dense_down)

    got, want = call(), ref()
    harness.check(report, label, [(got, want)])
    identical = float((got == want).float().mean())
    del got, want
    t, t_ref, t_dense = (harness.time_us(fn, device) for fn in (call, ref, dense))
    flops = 2 * num_tokens * k * 3 * i * h
    experts_hit = int(ids.unique().numel())
    expert_bytes = experts_hit * 3 * i * h * x.element_size()
    report.emit(
        {"kind": "moe", **label, "flops": flops, "experts_hit": experts_hit}
        | {"expert_bytes": expert_bytes, "ref_identical": round(identical, 4)}
        | {"time_us": round(t, 2), "tflops": harness.significant(flops / t / 1e6)}
        | {"gbps": harness.significant(expert_bytes / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_tflops": harness.significant(flops / t_ref / 1e6)}
        | {
            "dense_time_us": round(t_dense, 2),
            "dense_tflops": harness.significant(flops / t_dense / 1e6),
        }
        | {"dense_ratio": harness.significant(t_dense / t)}
        | harness.speed_fields(t, t_ref, None)
    )
