"""Compile the Triton kernels for a GPU architecture on a machine without a GPU.

    python -m benchmarks.kernel_compile [--arch 90] [--json]

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute but not that they compile:
a construct the interpreter accepts may still be rejected by Triton's compiler, and the compiled
code may spill registers or need more shared memory than an SM has. This tool drives the real
wrappers in `kernels.triton_attention` (paged attention, KV-cache write, KV-block copy, each
also with an fp8 KV cache),
`kernels.triton_fused` (norms, SwiGLU, rotary + cache write) and `kernels.triton_moe` (fused
mixture of experts) with CPU tensors, swaps Triton's GPU driver for one that only names the
target, and turns each launch into a compile (`JITFunction.run` with
warmup=True). Triton's bundled ptxas produces the cubin, and its cuobjdump reports the resources:
registers per thread, local memory (spills) and shared memory.

It needs a Triton with the NVIDIA backend (the Linux wheels have it) and must run without
TRITON_INTERPRET set. Triton internals are used (driver.set_active, JITFunction.run), so a new
Triton release may need this file adjusted; the kernels themselves do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# H100/H200: 227 KiB of shared memory per block (opt-in maximum).
MAX_SHARED_BYTES = 232448


@dataclass(frozen=True)
class Variant:
    """One launch configuration: which wrapper, and the shapes and dtype that pick constexprs."""

    name: str
    # attention: "decode" | "extend" | "invariant" (the default paged_attention: the extend
    # kernel in `invariant_config`) | "cache" | "copy_blocks"; fused: "rms_norm" |
    # "add_rms_norm" | "silu_and_mul" | "gelu_tanh_and_mul" | "rotary_cache"; "moe"
    kind: str
    dtype: torch.dtype
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_splits: int = 1
    sliding_window: int | None = None
    softcap: float | None = None  # attention-logit soft-capping (Gemma 2)
    unit_offset: bool = False  # the norms: Gemma's (1 + weight)
    num_seqs: int = 3
    hidden_size: int = 0  # the norms' row
    intermediate_size: int = 0  # silu/gelu_tanh_and_mul's output row; an expert's (moe)
    num_experts: int = 0  # moe: experts, experts per token, tokens (which pick the tile config)
    top_k: int = 0
    num_tokens: int = 0
    activation: str = "silu"
    # The KV cache's dtype (attention, cache write, block copy, rotary + cache write); None: the
    # activation dtype. An fp8 cache (float8_e4m3fn, float8_e5m2) is launched with both k_scale
    # and v_scale given, the engine's calibrated path (HAS_KV_SCALES).
    kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


# Fused-MoE layer shapes: (hidden, expert intermediate, experts, experts per token).
QWEN3_30B_A3B_MOE = (2048, 768, 128, 8)
MIXTRAL_8X7B_MOE = (4096, 14336, 8, 2)


def _moe_variant(
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    num_tokens: int,
    activation: str = "silu",
) -> Variant:
    hidden, inter, experts, top_k = shape
    return Variant(
        name, "moe", dtype, hidden_size=hidden, intermediate_size=inter, num_experts=experts,
        top_k=top_k, num_tokens=num_tokens, activation=activation,
    )  # fmt: skip


GEMMA2_ATTENTION: dict[str, Any] = dict(sliding_window=4096, softcap=50.0)
FP8_E4M3, FP8_E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# What the engine and the benchmark launch: Llama-3 8B/1B heads (32/8, D 128/64), SmolLM2 (9/3),
# MHA and GQA 8, every dtype, split and unsplit decode, sliding windows, a single sequence
# (Triton specialises an int argument equal to 1 as a constant), and fp8 KV caches.
VARIANTS = [
    Variant("decode-8b", "decode", torch.bfloat16, 32, 8, 128),
    Variant("decode-8b-split8", "decode", torch.bfloat16, 32, 8, 128, num_splits=8),
    Variant("decode-1b-fp16", "decode", torch.float16, 32, 8, 64),
    Variant("decode-smollm2-window", "decode", torch.bfloat16, 9, 3, 64, sliding_window=64),
    Variant("decode-gqa8-split4-one-seq", "decode", torch.bfloat16, 64, 8, 128, 4, num_seqs=1),
    Variant("decode-mha-fp32", "decode", torch.float32, 8, 8, 128, num_splits=2),
    # An fp8 KV cache at Llama-3 8B (bf16 activations, k_scale and v_scale given): the tiles are
    # dequantized in registers after the load, so these are the decode variants to watch for
    # spills; e5m2 once, as its conversion differs from e4m3's.
    Variant("decode-8b-fp8", "decode", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    Variant("decode-8b-split8-fp8", "decode", torch.bfloat16, 32, 8, 128, 8, kv_dtype=FP8_E4M3),
    Variant("decode-8b-fp8-e5m2", "decode", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E5M2),
    Variant("extend-8b", "extend", torch.bfloat16, 32, 8, 128),
    Variant("extend-1b", "extend", torch.bfloat16, 32, 8, 64),
    Variant("extend-smollm2-window", "extend", torch.bfloat16, 9, 3, 64, sliding_window=64),
    Variant("extend-mha-fp16-one-seq", "extend", torch.float16, 16, 16, 128, num_seqs=1),
    Variant("extend-gqa8-fp32", "extend", torch.float32, 16, 2, 64),
    Variant("extend-8b-fp8", "extend", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    # The default (batch-invariant) configuration, which every step runs unless
    # PAGEDSERVE_BATCH_VARIANT=1: 16-row query tiles (32 for GQA 32), every key tile masked.
    Variant("invariant-8b", "invariant", torch.bfloat16, 32, 8, 128),
    Variant("invariant-1b-fp16", "invariant", torch.float16, 32, 8, 64),
    Variant("invariant-smollm2-window", "invariant", torch.bfloat16, 9, 3, 64, sliding_window=64),
    Variant("invariant-mha-fp32", "invariant", torch.float32, 8, 8, 128),
    Variant("invariant-gqa32-one-seq", "invariant", torch.bfloat16, 32, 1, 128, num_seqs=1),
    Variant("invariant-8b-fp8", "invariant", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    # Gemma-2-9B: head_dim 256, GQA 2, a 4096-key window on every other layer, logits capped at 50.
    Variant("decode-gemma2-9b-softcap", "decode", torch.bfloat16, 16, 8, 256, **GEMMA2_ATTENTION),
    Variant("extend-gemma2-9b-softcap", "extend", torch.bfloat16, 16, 8, 256, **GEMMA2_ATTENTION),
    Variant(
        "invariant-gemma2-9b-softcap", "invariant", torch.bfloat16, 16, 8, 256, **GEMMA2_ATTENTION
    ),
    Variant("cache-8b", "cache", torch.bfloat16, 32, 8, 128),
    Variant("cache-smollm2-fp32", "cache", torch.float32, 9, 3, 64),
    Variant("cache-8b-fp8", "cache", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    # Copy-on-write of shared blocks in every dtype the engine runs: a Llama-3 8B block of
    # 16 x 8 x 128 elements, four programs of BLOCK 4096 each per block and cache.
    Variant("copy-blocks-8b", "copy_blocks", torch.bfloat16, 32, 8, 128),
    Variant("copy-blocks-8b-fp16", "copy_blocks", torch.float16, 32, 8, 128),
    Variant("copy-blocks-8b-fp32", "copy_blocks", torch.float32, 32, 8, 128),
    Variant("copy-blocks-8b-fp8", "copy_blocks", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    # The fused layer ops at Llama-3 1B / 8B / 70B, SmolLM2 and Qwen2-0.5B sizes: rows of 576 to
    # 8192 (1 to 16 warps), masked rows (576, 896, 1536) and GQA 1-8 head layouts.
    Variant("rms-norm-1b", "rms_norm", torch.bfloat16, hidden_size=2048),
    Variant("rms-norm-8b-fp16", "rms_norm", torch.float16, hidden_size=4096),
    Variant("rms-norm-70b", "rms_norm", torch.bfloat16, hidden_size=8192),
    Variant("rms-norm-smollm2-fp32", "rms_norm", torch.float32, hidden_size=576),
    Variant("add-rms-norm-1b", "add_rms_norm", torch.bfloat16, hidden_size=2048),
    Variant("add-rms-norm-70b", "add_rms_norm", torch.bfloat16, hidden_size=8192),
    Variant("add-rms-norm-qwen2-fp32", "add_rms_norm", torch.float32, hidden_size=896),
    Variant("silu-mul-1b", "silu_and_mul", torch.bfloat16, intermediate_size=8192),
    Variant("silu-mul-8b", "silu_and_mul", torch.bfloat16, intermediate_size=14336),
    Variant("silu-mul-smollm2-fp32", "silu_and_mul", torch.float32, intermediate_size=1536),
    # Gemma-2-9B's norms ((1 + weight), a masked 3584-wide row) and GeGLU.
    Variant("rms-norm-gemma2", "rms_norm", torch.bfloat16, hidden_size=3584, unit_offset=True),
    Variant(
        "add-rms-norm-gemma2", "add_rms_norm", torch.bfloat16, hidden_size=3584, unit_offset=True
    ),
    Variant("gelu-mul-gemma2", "gelu_tanh_and_mul", torch.bfloat16, intermediate_size=14336),
    Variant("rotary-cache-1b", "rotary_cache", torch.bfloat16, 32, 8, 64),
    Variant("rotary-cache-8b", "rotary_cache", torch.bfloat16, 32, 8, 128),
    Variant("rotary-cache-70b", "rotary_cache", torch.bfloat16, 64, 8, 128),
    Variant("rotary-cache-smollm2-fp32", "rotary_cache", torch.float32, 9, 3, 64),
    Variant("rotary-cache-qwen2-fp16", "rotary_cache", torch.float16, 14, 2, 64),
    Variant("rotary-cache-8b-fp8", "rotary_cache", torch.bfloat16, 32, 8, 128, kv_dtype=FP8_E4M3),
    # Fused MoE at Qwen3-30B-A3B and Mixtral-8x7B sizes, for a decode batch (16-row tiles) and a
    # prefill chunk (64-row tiles: more tokens than experts); GELU and top-1 (no top-k sum) once.
    _moe_variant("moe-qwen3-30b-a3b-n1", torch.bfloat16, QWEN3_30B_A3B_MOE, 1),
    _moe_variant("moe-qwen3-30b-a3b-n256", torch.bfloat16, QWEN3_30B_A3B_MOE, 256),
    _moe_variant("moe-mixtral-8x7b-n1", torch.bfloat16, MIXTRAL_8X7B_MOE, 1),
    _moe_variant("moe-mixtral-8x7b-n256", torch.bfloat16, MIXTRAL_8X7B_MOE, 256),
    _moe_variant("moe-qwen3-30b-a3b-gelu-n16", torch.bfloat16, QWEN3_30B_A3B_MOE, 16, "gelu_tanh"),
    _moe_variant("moe-top1-fp16-n64", torch.float16, (1024, 512, 16, 1), 64),
]

FUSED_KINDS = ("rms_norm", "add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_cache")
# The kinds that read or write a KV cache, whose dtype `kv_dtype` sets.
KV_CACHE_KINDS = ("decode", "extend", "invariant", "cache", "copy_blocks", "rotary_cache")


def _install_compile_only_driver(arch: int) -> list[tuple[str, Any]]:
    """Make every kernel launch compile for sm_`arch` and record the compiled kernel instead."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    driver.set_active(CompileOnlyDriver())
    compiled: list[tuple[str, Any]] = []
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    return compiled


def _launch(variant: Variant) -> None:
    """Call the public wrapper (or the decode entry with a forced split, the extend entry in its
    batch-variant configuration) on CPU tensors."""
    from pagedserve.kernels import triton_attention

    if variant.kind in FUSED_KINDS:
        _launch_fused(variant)
        return
    if variant.kind == "moe":
        _launch_moe(variant)
        return
    block_size, context = 16, 40
    dtype, hq, hkv, d = variant.dtype, variant.num_heads, variant.num_kv_heads, variant.head_dim
    num_seqs = variant.num_seqs
    k_cache = torch.zeros(num_seqs * 4, block_size, hkv, d, dtype=variant.cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = _kv_scales(variant)
    if variant.kind == "cache":
        kv = torch.zeros(8, hkv, d, dtype=dtype)
        triton_attention.reshape_and_cache(kv, kv, k_cache, v_cache, torch.arange(8), **scales)
        return
    if variant.kind == "copy_blocks":
        # Two layers' K and V caches; the block ids are runtime values, not constexprs.
        caches = [k_cache, v_cache, torch.zeros_like(k_cache), torch.zeros_like(k_cache)]
        triton_attention.copy_blocks(caches, torch.tensor([0, 2]), torch.tensor([1, 3]))
        return
    q_len = 1 if variant.kind == "decode" else 5
    q = torch.zeros(num_seqs * q_len, hq, d, dtype=dtype)
    block_tables = torch.arange(num_seqs * 4, dtype=torch.int32).view(num_seqs, 4)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, d**-0.5)
    if variant.kind == "decode":
        out = torch.empty_like(q)
        triton_attention.decode(
            *args, variant.sliding_window, out, variant.num_splits, softcap=variant.softcap,
            **scales,
        )  # fmt: skip
    elif variant.kind == "extend":
        triton_attention.extend(
            *args, variant.sliding_window, torch.empty_like(q), softcap=variant.softcap, **scales
        )
    else:
        triton_attention.paged_attention(
            *args, sliding_window=variant.sliding_window, softcap=variant.softcap, **scales
        )


def _kv_scales(variant: Variant) -> dict[str, torch.Tensor]:
    """k_scale and v_scale for an fp8 cache (float32 [1], as the engine passes them), else none."""
    from pagedserve.kernels.fp8 import is_fp8

    if not is_fp8(variant.cache_dtype):
        return {}
    return {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}


def _launch_fused(variant: Variant) -> None:
    from pagedserve.kernels import triton_fused

    dtype, num_tokens = variant.dtype, 8
    if variant.kind in ("rms_norm", "add_rms_norm"):
        x = torch.zeros(num_tokens, variant.hidden_size, dtype=dtype)
        weight = torch.ones(variant.hidden_size, dtype=dtype)
        if variant.kind == "rms_norm":
            triton_fused.rms_norm(x, weight, 1e-5, unit_offset=variant.unit_offset)
        else:
            triton_fused.fused_add_rms_norm(
                x, torch.zeros_like(x), weight, 1e-5, unit_offset=variant.unit_offset
            )
    elif variant.kind in ("silu_and_mul", "gelu_tanh_and_mul"):
        act_and_mul = getattr(triton_fused, variant.kind)
        act_and_mul(torch.zeros(num_tokens, 2 * variant.intermediate_size, dtype=dtype))
    else:
        hq, hkv, d = variant.num_heads, variant.num_kv_heads, variant.head_dim
        qkv = torch.zeros(num_tokens, (hq + 2 * hkv) * d, dtype=dtype)
        tables = torch.zeros(64, d), torch.zeros(64, d)
        k_cache = torch.zeros(4, 16, hkv, d, dtype=variant.cache_dtype)
        positions = torch.arange(num_tokens)
        triton_fused.rotary_and_cache(
            qkv, positions, *tables, k_cache, torch.zeros_like(k_cache), positions, hq, hkv, d,
            **_kv_scales(variant),
        )  # fmt: skip


def _launch_moe(variant: Variant) -> None:
    from pagedserve.kernels import triton_moe

    dtype, n, k = variant.dtype, variant.num_tokens, variant.top_k
    h, i, e = variant.hidden_size, variant.intermediate_size, variant.num_experts
    # Uninitialised weights: nothing is launched, and torch.empty does not touch the pages of
    # Mixtral's 2.8 GB of experts.
    gate_up = torch.empty(e, 2 * i, h, dtype=dtype)
    down = torch.empty(e, h, i, dtype=dtype)
    weights, ids = torch.rand(n, k).softmax(-1), torch.rand(n, e).topk(k, dim=-1).indices
    x = torch.zeros(n, h, dtype=dtype)
    triton_moe.fused_moe(x, gate_up, down, weights, ids, activation=variant.activation)


def _resources(cubin: bytes, tool_dir: Path) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [str(tool_dir / "cuobjdump"), "-res-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", report))
    return {
        "registers": int(usage["REG"]),
        "stack_bytes": int(usage["STACK"]),
        "local_bytes": int(usage["LOCAL"]),  # > 0: registers spilled to local memory
    }


def compile_all(arch: int) -> list[dict[str, Any]]:
    """Compile every variant; one record per compiled kernel (decode with splits has two)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ValueError("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import triton

    compiled = _install_compile_only_driver(arch)
    from pagedserve.kernels import triton_attention

    # The wrappers refuse CPU tensors outside the interpreter; here nothing is launched.
    triton_attention.check_runnable = lambda device: None
    tool_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    records = []
    for variant in VARIANTS:
        start = len(compiled)
        _launch(variant)
        for kernel_name, kernel in compiled[start:]:
            fields = asdict(variant)
            fields["dtype"] = str(variant.dtype).removeprefix("torch.")
            # The cache's dtype where the kernel touches a KV cache, else None.
            fields["kv_dtype"] = (
                str(variant.cache_dtype).removeprefix("torch.")
                if variant.kind in KV_CACHE_KINDS
                else None
            )
            records.append(
                {
                    "variant": variant.name,
                    "kernel": kernel_name,
                    **{k: v for k, v in fields.items() if k != "name"},
                    "arch": arch,
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "shared_bytes": kernel.metadata.shared,
                    **_resources(kernel.asm["cubin"], tool_dir),
                }
            )
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = compile_all(args.arch)
    problems = [r for r in records if r["local_bytes"] > 0 or r["shared_bytes"] > MAX_SHARED_BYTES]
    for r in records:
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['variant']:28} {r['kernel']:26} warps {r['num_warps']} stages "
                f"{r['num_stages']}  regs {r['registers']:3}  spill {r['local_bytes']:4} B  "
                f"shared {r['shared_bytes'] / 1024:6.1f} KiB"
            )
    if problems:
        print(f"{len(problems)} kernels spill registers or exceed shared memory:", file=sys.stderr)
        for r in problems:
            print(
                f"  {r['variant']} {r['kernel']}: spill {r['local_bytes']} B, shared "
                f"{r['shared_bytes']} B (max {MAX_SHARED_BYTES})",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
