"""The Triton kernels compile for the H100/H200 (sm_90) on a machine without a GPU, without
spilling registers and within the shared memory of an SM.

The interpreter tests (test_triton.py) check what the kernels compute; only Triton's compiler can
reject what the interpreter accepts (a non-constexpr global, a loop-carried type change, ...).
`bench.kernel_compile` runs the real wrappers with the launch turned into a compile, and reads the
resources of each cubin with the cuobjdump bundled with Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from benchmarks.kernel_compile import MAX_SHARED_BYTES, VARIANTS

NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(
    not (NVIDIA_TOOLS / "ptxas").exists(),
    reason="this Triton build has no NVIDIA backend (ptxas) to compile with",
)
def test_every_variant_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_compile", "--arch", "90", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    kernels_by_variant: dict[str, list[str]] = {}
    for r in records:
        kernels_by_variant.setdefault(r["variant"], []).append(r["kernel"])
        assert r["local_bytes"] == 0, r  # no register spills
        assert r["shared_bytes"] <= MAX_SHARED_BYTES, r
        assert 0 < r["registers"] <= 255, r
    expected = {
        "decode": ["_decode_kernel"],
        "extend": ["_extend_kernel"],
        "invariant": ["_extend_kernel"],
        "cache": ["_reshape_and_cache_kernel"],
        "copy_blocks": ["_copy_blocks_kernel"],
        "rms_norm": ["_rms_norm_kernel"],
        "add_rms_norm": ["_rms_norm_kernel"],
        "silu_and_mul": ["_silu_and_mul_kernel"],
        "gelu_tanh_and_mul": ["_silu_and_mul_kernel"],  # the same kernel, ACTIVATION="gelu_tanh"
        "rotary_cache": ["_rotary_and_cache_kernel"],
        "moe": ["_moe_gate_up_kernel", "_moe_down_kernel", "_moe_sum_kernel"],
    }
    for v in VARIANTS:
        want = list(expected[v.kind])
        if v.kind == "decode" and v.num_splits > 1:
            want.append("_merge_splits_kernel")
        if v.kind == "moe" and v.top_k == 1:
            want.remove("_moe_sum_kernel")  # one expert per token: nothing to sum
        assert kernels_by_variant[v.name] == want
    # Every variant compiled, and copy_blocks in each dtype the engine's caches take.
    assert list(kernels_by_variant) == [v.name for v in VARIANTS]
    copy_dtypes = {r["kv_dtype"] for r in records if r["kernel"] == "_copy_blocks_kernel"}
    assert copy_dtypes == {"bfloat16", "float16", "float32", "float8_e4m3fn"}
    # The fp8 KV cache (k_scale and v_scale given) through every kernel that touches a cache:
    # e4m3 everywhere, split and unsplit decode, and e5m2 decode once.
    fp8 = {
        (r["kind"], r["kernel"], r["num_splits"] > 1, r["kv_dtype"])
        for r in records
        if r["kv_dtype"] in ("float8_e4m3fn", "float8_e5m2")
    }
    assert {
        ("decode", "_decode_kernel", False, "float8_e4m3fn"),
        ("decode", "_decode_kernel", True, "float8_e4m3fn"),
        ("decode", "_merge_splits_kernel", True, "float8_e4m3fn"),
        ("decode", "_decode_kernel", False, "float8_e5m2"),
        ("extend", "_extend_kernel", False, "float8_e4m3fn"),
        ("invariant", "_extend_kernel", False, "float8_e4m3fn"),
        ("cache", "_reshape_and_cache_kernel", False, "float8_e4m3fn"),
        ("rotary_cache", "_rotary_and_cache_kernel", False, "float8_e4m3fn"),
        ("copy_blocks", "_copy_blocks_kernel", False, "float8_e4m3fn"),
    } <= fp8
    assert all(r["kv_dtype"] is None for r in records if r["kind"] in ("moe", "rms_norm"))
    # Fused MoE at the Qwen3-30B-A3B and Mixtral-8x7B shapes, in decode and prefill tiles.
    moe = {
        (r["hidden_size"], r["num_experts"], r["num_tokens"]) for r in records if r["kind"] == "moe"
    }
    assert {(2048, 128, 1), (2048, 128, 256), (4096, 8, 1), (4096, 8, 256)} <= moe
