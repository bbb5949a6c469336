"""`python -m benchmarks.gpu_kernels --smoke` end to end on CPU: the Triton kernels run under
the interpreter, are checked against the torch reference, and every record the GPU run writes is
written, with the byte and FLOP counts the rates are computed from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The smoke plan's copy_blocks cases: 1 and 3 blocks in 2 layers' K and V caches.
COPY_CASES = ["tiny 2 layers copy1", "tiny 2 layers copy3"]
# The smoke plan's fused cases: every op for 1 token, then for 5.
FUSED_CASES = [
    f"{op} n{n}"
    for n in (1, 5)
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")
]
# The smoke plan's MoE cases: the tiny layer (hidden 96, experts of 80, 8 experts, top 2) for 1
# token (16-row tiles) and 12 (more tokens than experts: 64-row tiles).
MOE_CASES = ["tiny-moe n1", "tiny-moe n12"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # CUDA hidden: the smoke run must take the CPU path wherever the suite runs.
    env = os.environ | {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kernels", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_smoke_run_checks_the_triton_kernels_and_writes_every_record(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "kernels.jsonl"
    done = _run("--smoke", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = _records(out.read_text())
    assert _records(done.stdout) == records  # stdout is JSON lines only; the table is on stderr
    assert "checks: 19/19 ok" in done.stderr

    env = records[0]
    assert env["kind"] == "env"
    assert (env["device"], env["dtype"], env["smoke"]) == ("cpu", "float16", True)
    assert env["kernels"] == "pagedserve.kernels.triton_attention"
    assert env["fused_kernels"] == "pagedserve.kernels.triton_fused"
    assert env["moe_kernels"] == "pagedserve.kernels.triton_moe"
    assert Counter(r["kind"] for r in records) == {
        "env": 1,
        "check": 19,
        "decode": 2,  # over the float16 cache, then over an fp8 one
        "prefill": 2,
        "cache": 1,
        "copy": 2,
        "fused": 8,
        "moe": 2,
    }

    checks = [r for r in records if r["kind"] == "check"]
    assert [(r["scenario"], r["case"]) for r in checks[:7]] == [
        ("decode", "tiny b2 ctx64"),
        ("decode", "tiny b2 ctx64 window32"),
        ("decode", "tiny b2 ctx64 fp8"),
        ("decode", "tiny b2 ctx64 fp8 rescaled"),
        ("prefill", "tiny 2x32 +0"),
        ("prefill", "tiny 2x32 +32"),
        ("cache", "tiny 256 tokens"),
    ]
    assert [(r["scenario"], r["case"]) for r in checks[7:9]] == [("copy", c) for c in COPY_CASES]
    assert [r["case"] for r in checks[9:17]] == FUSED_CASES
    assert [(r["scenario"], r["case"]) for r in checks[17:]] == [("moe", c) for c in MOE_CASES]
    assert all(r["ok"] is True for r in checks), checks
    assert [r["sliding_window"] for r in checks[:4]] == [None, 32, None, None]
    assert all(r["max_abs_err"] <= r["atol"] for r in checks[:6])
    # The fp8 checks: the kernel and the reference over the same fp8 cache, then again after the
    # scales changed in place (eager on CPU; the same CUDA graph replayed with --cuda-graph).
    assert [r.get("kv_dtype") for r in checks[:4]] == [None, None, "fp8", "fp8"]
    assert checks[3]["cuda_graph"] is False
    # The cache write and the block copies are copies: exact, in every cache.
    assert all(r["max_abs_err"] == 0.0 and r["atol"] == r["rtol"] == 0.0 for r in checks[6:9])

    # 2 seqs x 64 tokens x 2 kv heads x 64 dims x (K, V) x 2 bytes; 1 byte over the fp8 cache
    decode, decode_fp8 = [r for r in records if r["kind"] == "decode"]
    assert decode["kv_bytes"] == 2 * 64 * 2 * 64 * 2 * 2
    assert (decode["kv_dtype"], decode_fp8["kv_dtype"]) == ("float16", "fp8")
    assert decode_fp8["case"] == "tiny b2 ctx64 fp8"
    assert decode_fp8["kv_bytes"] == 2 * 64 * 2 * 64 * 2 * 1
    # Against the kernel over the float16 cache, timed in the same run.
    assert decode_fp8["base_kv_dtype"] == "float16"
    assert decode_fp8["base_time_us"] == decode["time_us"]
    assert decode_fp8["base_gbps"] == decode["gbps"]
    assert decode_fp8["gbps"] == pytest.approx(decode_fp8["kv_bytes"] / decode_fp8["time_us"] / 1e3,
                                               rel=1e-3)  # fmt: skip
    assert decode_fp8["time_vs_base"] == pytest.approx(
        decode_fp8["time_us"] / decode["time_us"], rel=1e-3
    )
    assert decode_fp8["ratio"] == pytest.approx(1 / decode_fp8["time_vs_base"], rel=2e-3)
    # What quantization changes: a little (e4m3 keeps 4 significant bits), not nothing.
    assert 0 < decode_fp8["base_max_abs_err"] < 0.5
    assert "sdpa_gbps" not in decode_fp8
    # 4 * head_dim * heads * visible (query, key) pairs * seqs: 32 new tokens see 1..32 keys
    # (528 pairs), or 33..64 keys on a 32-token prefix (32 * 32 + 528 = 1552 pairs)
    prefill = [r for r in records if r["kind"] == "prefill"]
    assert [r["flops"] for r in prefill] == [4 * 64 * 4 * 528 * 2, 4 * 64 * 4 * 1552 * 2]
    assert [r["sdpa_mask"] for r in prefill] == ["is_causal", "causal_lower_right"]
    (cache,) = [r for r in records if r["kind"] == "cache"]
    assert cache["bytes_written"] == 2 * 256 * 2 * 64 * 2
    # n blocks of 16 tokens x 2 kv heads x 64 dims x 2 bytes, read and written, in 2 x (K, V)
    copy = [r for r in records if r["kind"] == "copy"]
    assert [r["case"] for r in copy] == COPY_CASES
    assert [(r["num_layers"], r["num_caches"], r["num_blocks"]) for r in copy] == [(2, 4, 8)] * 2
    assert [r["block_bytes"] for r in copy] == [16 * 2 * 64 * 2] * 2
    assert [r["bytes"] for r in copy] == [2 * n * 4 * 16 * 2 * 64 * 2 for n in (1, 3)]

    fused = [r for r in records if r["kind"] == "fused"]
    assert [r["case"] for r in fused] == FUSED_CASES
    # float16 within 2 ulps (rtol 2 * 2^-10) of the reference; the model's own code is the
    # reference's math exactly.
    assert all(r["rtol"] == 2 * 2**-10 and r["atol"] == 1e-5 for r in checks[9:17])
    assert all(r["model_max_abs_err"] == 0.0 and r["model_ratio"] > 0 for r in fused)
    # Bytes each op moves, per token of the tiny layer (hidden 96, intermediate 160, 4 q and 2 kv
    # heads of 64): x and out (+ the weight once); x, residual in, residual out and out;
    # gate_up and out; qkv read, q, k and v written, a cos and a sin row, position and slot.
    per_token = {
        "rms_norm": 2 * 96 * 2,
        "fused_add_rms_norm": 4 * 96 * 2,
        "silu_and_mul": 3 * 160 * 2,
        "rotary_and_cache": 2 * 8 * 64 * 2 + 2 * 64 * 4 + 16,
    }
    weight = {"rms_norm": 96 * 2, "fused_add_rms_norm": 96 * 2}
    for r in fused:
        assert r["bytes"] == r["num_tokens"] * per_token[r["op"]] + weight.get(r["op"], 0), r

    moe = [r for r in records if r["kind"] == "moe"]
    assert [r["case"] for r in moe] == MOE_CASES
    assert all(r["max_abs_err"] <= r["atol"] for r in checks[17:])
    # 2 FLOPs x tokens x top 2 x (gate, up and down: 3 x 80 x 96); the distinct experts' three
    # 80 x 96 float16 matrices read (one token: its 2; 12 tokens x 2 hit all 8 here).
    assert [r["flops"] for r in moe] == [2 * n * 2 * 3 * 80 * 96 for n in (1, 12)]
    assert [r["experts_hit"] for r in moe] == [2, 8]
    assert all(r["expert_bytes"] == r["experts_hit"] * 3 * 80 * 96 * 2 for r in moe)
    assert all(r["dense_time_us"] > 0 and r["dense_ratio"] > 0 for r in moe)
    assert all(0.9 < r["ref_identical"] <= 1 for r in moe)  # float16: mostly bit-identical

    for r in [decode, *prefill, cache, *copy, *fused, *moe]:
        assert r["time_us"] > 0 and r["ratio"] > 0
        assert r["target"] is None and r["ok"] is None  # no speed claims on CPU
    assert decode_fp8["time_us"] > 0 and decode_fp8["ratio"] > 0 and decode_fp8["ok"] is None
    assert "tiny b2 ctx64 fp8" in done.stderr  # in the table
    for r in [decode, *prefill]:
        # The SDPA baseline attends over the same K/V as the paged kernel.
        assert r["sdpa_max_abs_err"] <= 2e-2


def test_only_selects_scenarios_in_run_order():
    # The torch reference as the module under test: this checks the harness alone, quickly.
    done = _run(
        "--smoke",
        "--kernels",
        "pagedserve.kernels.reference",
        "--only",
        "copy,cache",
        "--only",
        "decode",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert [r["kind"] for r in records] == (
        ["env", "check", "check", "decode", "check", "check", "decode", "check", "cache"]
        + ["check", "copy"] * 2
    )
    assert [r["case"] for r in records[9::2]] == COPY_CASES
    assert records[0]["fused_kernels"] is None  # not imported without the fused scenario


def test_only_fused_runs_each_op_for_each_token_count():
    done = _run(
        "--smoke", "--only", "fused", "--kernels", "pagedserve.kernels.reference",
        "--fused-kernels", "pagedserve.kernels.reference",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert records[0]["fused_kernels"] == "pagedserve.kernels.reference"
    assert [r["kind"] for r in records] == ["env"] + ["check", "fused"] * 8
    assert [r["case"] for r in records[1::2]] == FUSED_CASES
    # The reference against itself: exact.
    assert all(r["ok"] and r["max_abs_err"] == 0.0 for r in records[1::2])
    assert "vs model" in done.stderr and "checks: 8/8 ok" in done.stderr


def test_only_moe_times_the_reference_against_itself_and_the_dense_layer():
    done = _run("--smoke", "--only", "moe", "--moe-kernels", "pagedserve.kernels.reference")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert records[0]["moe_kernels"] == "pagedserve.kernels.reference"
    assert records[0]["fused_kernels"] is None
    assert [r["kind"] for r in records] == ["env"] + ["check", "moe"] * 2
    assert [r["case"] for r in records[1::2]] == MOE_CASES
    # The reference against itself: exact.
    assert all(r["ok"] and r["max_abs_err"] == 0.0 for r in records[1::2])
    assert all(r["ref_identical"] == 1.0 for r in records[2::2])
    assert "vs dense" in done.stderr and "checks: 2/2 ok" in done.stderr


def test_without_cuda_the_full_run_exits_2_and_says_why():
    done = _run()
    assert done.returncode == 2
    assert done.stdout == ""
    assert "no CUDA device" in done.stderr and "--smoke" in done.stderr


def test_sweep_times_every_configuration_and_checks_it():
    pytest.importorskip("triton")
    done = _run("--smoke", "--sweep", "--only", "decode,prefill")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert [r["kind"] for r in records] == ["env"] + ["sweep"] * 4  # instead of the regular run
    sweep = records[1:]
    # The smoke plan: 2 decode configs on one case, 2 prefill configs (block_m 32 and 64).
    assert [(r["scenario"], r["config"]["tile"], r["config"]["block_m"]) for r in sweep] == [
        ("decode", 32, 0),
        ("decode", 64, 0),
        ("prefill", 32, 32),
        ("prefill", 64, 64),
    ]
    assert all(r["matches_reference"] and r["time_us"] > 0 for r in sweep), sweep
    assert [r["num_splits"] for r in sweep[:2]] == [1, 1]
    assert "sweep tiny 2x32 +32" in done.stderr and "best" in done.stderr


def test_the_scripts_invariance_step_checks_bits_and_times_both_paths(tmp_path):
    """`ONLY=invariance bash benchmarks/gpu_kernels.sh` with SMOKE=1: the GPU step, tiny, on the
    CPU."""
    pytest.importorskip("triton")
    env = os.environ | {
        "SMOKE": "1",
        "ONLY": "invariance",
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("TRITON_INTERPRET", None)  # the script sets it
    done = subprocess.run(
        ["bash", "benchmarks/gpu_kernels.sh"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "invariance: rc=0 in " in done.stdout
    assert "kernels:" not in done.stdout  # ONLY: the other steps are skipped
    records = _records((tmp_path / "invariance.jsonl").read_text())
    assert records[0]["kind"] == "env" and records[0]["smoke"] is True
    checks = [r for r in records if r["kind"] == "check"]
    # --dtype (float16 on CPU), plain: 7 compositions (the GPU's run adds float32 and windowed +
    # soft-capped ones; tests/kernels/test_triton_batch_invariance.py checks those here).
    assert len(checks) == 7
    assert all(r["ok"] and r["max_abs_err"] == 0.0 and r["atol"] == 0.0 for r in checks), checks
    assert {r["dtype"] for r in checks} == {"float16"}
    assert [r["case"] for r in checks[:7]] == [
        "tiny float16: " + name
        for name in ("prompt in chunks", "decode alone", "decode 0 of 8", "decode 4 of 8",
                     "decode 7 of 8", "decode in a mixed step", "last chunk in a mixed step")
    ]  # fmt: skip
    # The batch-variant dispatch, on the same steps, is not invariant: the checks can fail.
    assert not all(r["variant_same_bits"] for r in checks)
    costs = [r for r in records if r["kind"] == "invariance"]
    assert [r["case"] for r in costs] == ["tiny b2 ctx64", "tiny b1 ctx160", "tiny 2x32 +32"]
    for r in costs:
        assert r["time_us"] > 0 and r["variant_time_us"] > 0
        assert r["cost"] == pytest.approx(r["time_us"] / r["variant_time_us"], rel=1e-3)
        assert r["max_abs_err"] <= 2e-2 and r["variant_max_abs_err"] <= 2e-2
    text = (tmp_path / "invariance.txt").read_text()
    assert "invariance: 7/7 compositions bit for bit the same by default" in text
    assert "cost tiny b1 ctx160" in text
