"""`bash benchmarks/gpu_engine.sh` with SMOKE=1: every step of the H200 script runs on the CPU with
a tiny Llama, and every record the GPU run writes is written, with the exact token counts the
rates are computed from. Plus the pure parts: nano-vllm's workload, token comparison, and the
profile's summary of CUDA events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.gpu_engine import SMOKE_SIZES, TINY_LLAMA, compare_tokens, summarize
from pagedserve.bench.throughput import random_length_workload, random_token_prompts

REPO = Path(__file__).resolve().parents[2]
# The H200 script's steps run on the CPU (each in fresh interpreters, ~110 s in all): the check to
# run before each use of a GPU (`make test-slow`), outside the default suite's time budget. The
# engine paths they drive are tested directly by the default suite; the pure parts below stay.
SCRIPT_ON_CPU = pytest.mark.slow
STEP_NAMES = (
    "env", "correctness", "decode", "offline", "nano_qwen", "nano_llama", "online", "spec"
)  # fmt: skip


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("gpu_engine")
    return out, _run_script(out)


def _run_script(out: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "SMOKE": "1",
        "OUT": str(out),
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path wherever the suite runs
        # One thread: the smoke sizes gain nothing from more, and a busy machine's spinning
        # OpenMP threads slowed the steps several-fold.
        "OMP_NUM_THREADS": "1",
        **env_vars,
    }
    return subprocess.run(
        ["bash", "benchmarks/gpu_engine.sh"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _records(out: Path, step: str) -> list[dict]:
    """The step's records, none of them a failed part's."""
    records = [json.loads(line) for line in (out / f"{step}.jsonl").read_text().splitlines()]
    errors = [r for r in records if "error" in r]
    assert not errors, errors[0].get("trace", errors[0]["error"])
    return records


def _where(records: list[dict], **fields: object) -> list[dict]:
    """The records with these values (a record without a field has none of its values)."""
    return [r for r in records if all(r.get(k) == v for k, v in fields.items())]


def _both_engines_equal(checks: list[dict], **fields: object) -> None:
    """A check of the default engine (CUDA graphs where there are any) and the eager one: both
    equal to the reference, each with these values."""
    assert [(r["engine"], r["equal"]) for r in checks] == [("default", True), ("eager", True)]
    assert all(r[k] == v for r in checks for k, v in fields.items()), checks


def _rates_measured(records: list[dict], *rates: str) -> None:
    """The step's one throughput record has these rates, each above zero."""
    (throughput,) = _where(records, kind="throughput")
    assert all(throughput[rate] > 0 for rate in rates), throughput


def _run_alone(out: Path, step: str) -> tuple[list[dict], str]:
    """`ONLY=step`: the step's records and the summary, from a run where no other step ran."""
    done = _run_script(out, ONLY=step)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith(f"{step}: rc=0 in ")
    return _records(out, step), (out / "summary.txt").read_text()


@SCRIPT_ON_CPU
def test_every_step_runs_and_the_summary_is_written(smoke):
    out, done = smoke
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in STEP_NAMES:
        assert f"{name}: rc=0 in " in done.stdout, done.stdout
    summary = (out / "summary.txt").read_text()
    assert "ERROR" not in summary and "no records" not in summary
    assert summary == summarize(out) + "\n"
    for step in ("correctness", "decode", "offline", "nano", "online", "spec"):
        assert f"\n{step}: " in summary
    assert (out / "commit.txt").read_text().strip()
    assert (out / "online_server.log").is_file()


@SCRIPT_ON_CPU
def test_env_record(smoke):
    out, _ = smoke
    (env,) = _records(out, "env")
    assert env["smoke"] is True and env["cuda_available"] is False
    assert env["commit"] and env["torch"]
    assert env["importable"]["gguf"] is True  # the engine imports it; wheels.sh brings it


@SCRIPT_ON_CPU
def test_correctness_fp32_equals_transformers_and_eager_equals_default(smoke):
    out, _ = smoke
    records = _records(out, "correctness")
    by_check = Counter((r["check"], r.get("engine")) for r in records)
    assert by_check == {
        ("float32_vs_transformers", "default"): 1,
        ("float32_vs_transformers", "eager"): 1,
        ("float32_eager_vs_default", None): 1,
        ("bfloat16_vs_transformers", "default"): 1,
        ("bfloat16_vs_transformers", "eager"): 1,
        ("bfloat16_eager_vs_default", None): 1,
        ("dummy_weights", None): 1,
    }
    n = SMOKE_SIZES.correctness_tokens
    lens = list(SMOKE_SIZES.correctness_prompt_lens)
    for r in records:
        if r["check"] == "dummy_weights":
            # Drawn once; loaded by 2 transformers models and 4 engines.
            assert (r["draws"], r["calls"]) == (1, 6)
            continue
        assert r["model"] == "tiny" and r["prompt_lens"] == lens and r["num_tokens"] == n
        assert r["num_prompts"] == len(lens) and len(r["prefix_match"]) == len(lens)
        assert all(0 <= k <= n for k in r["prefix_match"] + r["positionwise_match"])
        if r["check"].startswith("float32") or r["check"].endswith("eager_vs_default"):
            assert r["equal"] is True, r["mismatches"]
            assert r["prefix_match"] == [n] * len(lens) and r["mismatches"] == []
        if "engine" in r:  # CPU: the compiled CPU backend, no graphs
            assert r["attention_backend"] == "cpu" and r["cuda_graphs"] is False


def _tiny_weight_bytes_fp32() -> int:
    c = TINY_LLAMA
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * inter
    # The untied embedding is not read whole in a decode step; lm_head is.
    return 4 * (c["num_hidden_layers"] * per_layer + h + c["vocab_size"] * h)


@SCRIPT_ON_CPU
def test_decode_records(smoke):
    out, _ = smoke
    records = _records(out, "decode")
    kinds = Counter((r["kind"], r["enforce_eager"], r["batch_size"]) for r in records)
    assert kinds == {
        (kind, eager, b): 1
        for kind in ("step_time", "cpu_split", "profile")
        for eager in (False, True)
        for b in SMOKE_SIZES.decode_batch_sizes
    }
    kv_bytes_per_token = 2 * 4 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x fp32
    for r in records:
        assert r["cuda_graphs"] is False and r["attention_backend"] == "cpu"
        if r["kind"] == "step_time":
            assert r["num_steps"] == SMOKE_SIZES.decode_steps
            assert r["all_steps_pure_decode"] is True and r["prefill_steps"] >= 1
            assert r["weight_bytes"] == _tiny_weight_bytes_fp32()
            assert r["kv_bytes_per_step"] == int(
                r["batch_size"] * r["mean_context_len"] * kv_bytes_per_token
            )
            assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_p90"]
            assert ("target_ms" in r) == (r["batch_size"] == 1)
            if r["batch_size"] == 1:
                # One prefill step gives the first token, 3 warm-up steps 3 more: the 4 timed
                # steps attend to 24 + 4 .. 24 + 7 tokens.
                assert r["prefill_steps"] == 1 and r["mean_context_len"] == 29.5
        elif r["kind"] == "cpu_split":
            assert {"schedule", "execute", "update"} <= set(r["parts_ms"])
            parts = r["parts_ms"]
            assert parts["schedule"] + parts["execute"] + parts["update"] <= r["step_ms"] * 1.01
        else:
            assert r["num_steps"] == SMOKE_SIZES.profile_steps and r["wall_ms_per_step"] > 0
            assert "gpu_busy_ms_per_step" not in r  # no CUDA events on the CPU
            assert 0 < len(r["top_cpu_ops"]) <= 10


@SCRIPT_ON_CPU
def test_offline_record_counts_exact_tokens(smoke):
    out, _ = smoke
    records = _records(out, "offline")
    *engines, row = records
    assert [(r["kind"], r["engine"]) for r in engines] == [
        ("engine", "pagedserve"),
        ("engine", "transformers-static"),
        ("engine", "transformers"),
    ]
    assert row["kind"] == "comparison"
    for r in engines:  # each engine's record, written as it came, is its run in the row
        assert {k: r[k] for k in row["runs"][r["engine"]]} == row["runs"][r["engine"]]
    s = SMOKE_SIZES
    runs = row["runs"]
    assert runs["pagedserve"]["num_output_tokens"] == s.offline_prompts * s.offline_output_len
    for engine in ("transformers", "transformers-static"):
        num = s.offline_transformers_prompts if engine == "transformers" else s.offline_prompts
        assert runs[engine]["num_output_tokens"] == num * s.offline_output_len
    assert runs["pagedserve"]["num_preemptions"] == 0
    ours = runs["pagedserve"]["output_tokens_per_s"]
    assert row["ratio"] == round(ours / runs["transformers"]["output_tokens_per_s"], 2)
    assert row["ratio_vs_static"] == round(
        ours / runs["transformers-static"]["output_tokens_per_s"], 2
    )


@SCRIPT_ON_CPU
def test_nano_records_have_the_exact_output_tokens(smoke):
    out, _ = smoke
    records = _records(out, "nano")
    s = SMOKE_SIZES
    prompts, output_lens = random_length_workload(
        s.nano_prompts, s.nano_input_range, s.nano_output_range, TINY_LLAMA["vocab_size"], 0
    )
    assert [r["model"] for r in records] == ["qwen2.5-0.5b", "llama-3.2-1b"]
    for r in records:
        assert r["model_run"] == "tiny-llama"  # smoke: the tiny config stands in
        assert r["exact_output_tokens"] is True
        assert r["num_output_tokens"] == r["expected_output_tokens"] == sum(output_lens)
        assert r["num_input_tokens"] == sum(map(len, prompts))
        assert r["temperature"] == 0.6 and r["num_preemptions"] == 0
        assert r["request_seed"] is None and "--no-request-seeds" in r["command"]
        assert r["input_len_range"] == list(s.nano_input_range)
        assert "--input-len-range" in r["command"]


@SCRIPT_ON_CPU
def test_online_records(smoke):
    out, _ = smoke
    records = _records(out, "online")
    s = SMOKE_SIZES
    offline, *serves = records
    top_requests = s.online_runs[-1][1]
    assert offline["kind"] == "offline" and offline["num_prompts"] == top_requests
    assert offline["num_output_tokens"] == top_requests * s.online_output_len
    assert [(r["max_concurrency"], r["num_requests"]) for r in serves] == list(s.online_runs)
    for r in serves:
        assert r["completed"] == r["num_requests"] and r["failed"] == 0
        assert r["total_output_tokens"] == r["num_requests"] * s.online_output_len
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0
        assert r["median_itl_ms"] > 0 and 0 < r["client_cpu_fraction"]
    last = serves[-1]
    assert last["ratio_online_to_offline"] == round(
        last["output_throughput"] / offline["output_throughput"], 3
    )
    assert "ratio_online_to_offline" not in serves[0]


@SCRIPT_ON_CPU
def test_spec_records(smoke):
    out, _ = smoke
    records = _records(out, "spec")
    s = SMOKE_SIZES
    *specs, shared, weights = records
    assert [(r["kind"], r["batch_size"]) for r in specs] == [
        ("speculative", b) for b in s.spec_batch_sizes
    ]
    expected_tokens = s.spec_prompts * s.spec_output_len
    for r in specs:
        assert (r["prompt_len"], r["pattern_len"]) == (s.spec_prompt_len, s.spec_pattern_len)
        assert r["num_output_tokens"] == r["spec_num_output_tokens"] == expected_tokens
        assert r["same_tokens"] is True and r["num_equal_prompts"] == s.spec_prompts
        assert r["mismatches"] == [] and r["used_blocks_after"] == [0, 0]
        # The tiny model may or may not fall into loops the drafts can follow.
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        drafted = r["draft_tokens"]
        assert r["acceptance_rate"] == (
            round(r["accepted_tokens"] / drafted, 4) if drafted else None
        )
        # The rates are rounded to 0.1 tok/s, the ratio is of the unrounded ones.
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"], rel=0.01)
        # Without drafts one step per output token of each generate call (its first is the
        # prefill's); drafts can only save steps.
        assert r["plain_steps"] == -(-s.spec_prompts // r["batch_size"]) * s.spec_output_len
        assert r["spec_steps"] <= r["plain_steps"]
        for engine in (r["plain_engine"], r["spec_engine"]):
            assert engine["async_scheduling"] is False and engine["attention_backend"] == "cpu"
    assert shared["kind"] == "shared_blocks" and shared["n"] == 4
    assert shared["prompt_len"] % shared["block_size"] != 1  # the shared last block is partial
    assert shared["same_tokens"] is True and shared["samples_equal"] == [True] * 4
    # Equal samples would hide a missed copy; no ignore_eos, so a sample may end early.
    assert shared["num_distinct_samples"] == 4
    assert all(1 <= n <= shared["max_tokens"] for n in shared["sample_lens"])
    assert shared["num_block_copies"] > 0 and shared["num_used_blocks_end"] == 0
    # Drawn once; loaded by the plain and the speculative engine.
    assert weights == {
        "step": "spec",
        "smoke": True,
        "kind": "dummy_weights",
        "calls": 2,
        "draws": 1,
    }


# --- pure parts ------------------------------------------------------------------------------


@SCRIPT_ON_CPU
def test_the_moe_step_runs_alone_and_checks_the_experts_against_transformers(tmp_path):
    records, summary = _run_alone(tmp_path, "moe")
    checks = _where(records, check="fp32_greedy")
    _both_engines_equal(checks, num_prompts=len(SMOKE_SIZES.correctness_prompt_lens))
    (throughput,) = _where(records, kind="throughput")
    sizes = SMOKE_SIZES
    assert throughput["num_output_tokens"] == sizes.offline_prompts * sizes.offline_output_len
    assert throughput["num_active_params"] < throughput["num_params"]
    assert "moe: tiny-qwen3-moe fp32_greedy eager equal=True prompts 8/8" in summary


@SCRIPT_ON_CPU
def test_the_structured_step_runs_alone_and_checks_constrained_tokens(tmp_path):
    records, summary = _run_alone(tmp_path, "structured")
    checks = _where(records, check="fp32_constrained_greedy")
    _both_engines_equal(checks, live_matchers=0)
    assert checks[0]["kinds"] == ["regex", "choice", "json", "grammar"]
    (throughput,) = _where(records, kind="throughput")
    assert throughput["num_prompts"] == SMOKE_SIZES.offline_prompts
    assert (
        0
        < throughput["num_output_tokens"]
        <= (SMOKE_SIZES.offline_prompts * SMOKE_SIZES.offline_output_len)
    )
    assert "structured: tiny fp32_constrained_greedy eager equal=True prompts 8/8" in summary


def test_random_length_workload_is_nano_vllms():
    prompts, output_lens = random_length_workload(256, (100, 1024), (100, 1024), 151936, 0)
    # nano-vllm's README: 133,966 output tokens; its Qwen3.5 table: 142,827 prompt tokens.
    assert sum(output_lens) == 133_966
    assert sum(map(len, prompts)) == 142_827
    assert min(map(len, prompts)) >= 100 and max(map(len, prompts)) <= 1024
    assert min(min(p) for p in prompts) >= 0 and max(max(p) for p in prompts) == 10_000
    # A small vocabulary caps the ids.
    small, _ = random_length_workload(4, (5, 9), (1, 2), 64, 0)
    assert max(max(p) for p in small) <= 63


def test_fixed_length_workload_is_unchanged():
    from argparse import Namespace

    from pagedserve.bench.cli import build_parser
    from pagedserve.bench.throughput import build_workload

    command = "throughput --num-prompts 3 --input-len 5 --output-len 7 --seed 11"
    args = build_parser().parse_args(command.split())
    prompts, output_lens = build_workload(args, 50000, {2})
    assert prompts == random_token_prompts(3, 5, 50000, 11, {2})
    assert output_lens == [7, 7, 7]
    ranged = Namespace(**{**vars(args), "output_len_range": [2, 4], "dataset_seed": 3})
    prompts, output_lens = build_workload(ranged, 50000, {2})
    assert (prompts, output_lens) == random_length_workload(3, (5, 5), (2, 4), 50000, 3)
    with pytest.raises(ValueError, match="--output-len-range"):
        build_workload(Namespace(**{**vars(args), "output_len_range": [4, 2]}), 50000, {2})


def test_compare_tokens_reports_the_first_difference_and_its_margin():
    import torch

    scores = [torch.zeros(3, 10), torch.zeros(3, 10)]
    scores[1][1, 4], scores[1][1, 6] = 2.5, 2.0
    result = compare_tokens([[1, 2, 3], [4, 4, 4]], [[1, 2, 3], [4, 6, 4]], scores)
    assert result["equal"] is False and result["num_equal_prompts"] == 1
    assert result["prefix_match"] == [3, 1] and result["positionwise_match"] == [3, 2]
    assert result["mean_prefix_match"] == 2.0
    assert result["mismatches"] == [
        {
            "prompt": 1,
            "first_difference": 1,
            "reference_token": 4,
            "engine_token": 6,
            "reference_logit_margin": 0.5,
        }
    ]


def test_kernel_summary_of_cuda_events():
    """The CUDA branch of the profile summary (the smoke run has no CUDA events): GPU busy time
    is the union of kernel intervals, annotation ranges and host ops are left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu_engine.decode import _kernel_summary

    def event(name, start, end, device=DeviceType.CUDA, activity="kernel"):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(
            name=name, device_type=device, time_range=span, activity_type=activity
        )

    events = [
        event("gemm", 0, 100),
        event("attention", 50, 150),  # overlaps gemm: busy 0-150
        event("gemm", 300, 400),
        event("Memcpy HtoD", 500, 520, activity="gpu_memcpy"),
        event("decode step", 0, 1000, activity="gpu_user_annotation"),
        event("aten::mm", 0, 900, device=DeviceType.CPU, activity="cpu_op"),
    ]
    host = [SimpleNamespace(key="aten::mm", self_cpu_time_total=900.0, count=4)]
    prof = SimpleNamespace(events=lambda: events, key_averages=lambda: host)
    summary = _kernel_summary(prof, steps=2, wall_s=0.010, device="cuda")
    assert summary["wall_ms_per_step"] == 5.0
    assert summary["kernels_per_step"] == 2.0
    assert summary["kernel_ms_per_step"] == 0.16  # 320 us of kernels over 2 steps
    assert summary["gpu_busy_ms_per_step"] == 0.135  # 150 + 100 + 20 us
    assert summary["cpu_gap_ms_per_step"] == 4.865
    assert summary["top_kernels"] == [
        {"name": "gemm", "pct": 62.5, "calls_per_step": 1.0, "ms_per_step": 0.1},
        {"name": "attention", "pct": 31.25, "calls_per_step": 0.5, "ms_per_step": 0.05},
        {"name": "Memcpy HtoD", "pct": 6.25, "calls_per_step": 0.5, "ms_per_step": 0.01},
    ]
    assert summary["top_cpu_ops"] == [
        {"name": "aten::mm", "self_cpu_ms_per_step": 0.45, "calls_per_step": 2.0}
    ]


@SCRIPT_ON_CPU
def test_the_kvcap_step_runs_alone_and_checks_swap_and_fp8(tmp_path):
    records, summary = _run_alone(tmp_path, "kvcap")
    swaps = _where(records, check="fp32_swap_greedy")
    _both_engines_equal(swaps, swapped_blocks_left=0)
    # The pool is too small for all at once: requests were preempted, every one swapped out and
    # back in.
    assert all(r["swap_outs"] == r["swap_ins"] == r["preemptions"] > 0 for r in swaps)
    (fp8,) = _where(records, check="fp8_greedy_agreement")
    assert 0 < fp8["agreement"] <= 1
    _rates_measured(records, "bf16_tok_s", "fp8_tok_s")
    assert "kvcap: tiny fp32_swap_greedy eager equal=True prompts 8/8" in summary


@SCRIPT_ON_CPU
def test_the_tp_step_runs_alone_and_checks_the_distributed_path(tmp_path):
    records, summary = _run_alone(tmp_path, "tp")
    checks = [(r["check"], r["engine"], r["equal"]) for r in records if r.get("check")]
    # On CPU two ranks run too (gloo): the H200 has one GPU and records that check as skipped.
    assert checks == [
        ("fp32_tp1_greedy", "default", True),
        ("fp32_tp1_greedy", "eager", True),
        ("fp32_tp2_greedy", "default", True),
    ]
    _rates_measured(records, "plain_tok_s", "tp1_tok_s")
    assert "tp: tiny fp32_tp2_greedy default equal=True prompts 8/8" in summary


@SCRIPT_ON_CPU
def test_the_whisper_step_runs_alone_and_checks_transcriptions(tmp_path):
    records, summary = _run_alone(tmp_path, "whisper")
    (check,) = _where(records, check="fp32_greedy")
    assert (check["equal"], check["num_prompts"], check["blocks_free_after"]) == (True, 4, True)
    served = _where(records, kind="transcription")
    assert [(r["concurrency"], r["requests"]) for r in served] == [(1, 2), (2, 4)]
    # 3 s windows of the smoke model, each decoding at most 63 tokens (64 positions).
    assert all(r["audio_seconds_each"] == 3.0 for r in served)
    assert all(0 < r["output_tokens"] <= 63 * r["requests"] for r in served)
    line = f"whisper: whisper-tiny fp32_greedy {check['engine']} equal=True prompts 4/4"
    assert line in summary
    assert "served c=2 x4:" in summary


@SCRIPT_ON_CPU
def test_the_embed_step_runs_alone_and_checks_embeddings_and_token_rules(tmp_path):
    records, summary = _run_alone(tmp_path, "embed")
    (embeddings,) = _where(records, check="fp32_embeddings")
    assert (embeddings["prompts"], embeddings["ok"]) == (8, True)
    assert embeddings["max_abs_diff"] <= 1e-5  # on the CPU, the engine and transformers agree
    rules = [
        (r["cuda_graphs"], r["equal"]) for r in records if r.get("check") == "token_rules_greedy"
    ]
    assert rules == [(True, True), (False, True)]
    (speed,) = _where(records, part="throughput")
    assert speed["prompts"] == 16 and speed["pagedserve_tok_s"] > 0 < speed["transformers_tok_s"]
    assert "embed: tiny_bert fp32_embeddings 8 prompts max |diff|" in summary
    assert "embed: tiny token_rules_greedy graphs=False equal=True prompts 8/8" in summary


@SCRIPT_ON_CPU
def test_the_lora_step_runs_alone_and_checks_kernels_tokens_and_cost(tmp_path):
    records, summary = _run_alone(tmp_path, "lora")
    kernel_checks = [(r["check"], r["ok"]) for r in _where(records, model="kernels")]
    assert kernel_checks == [("triton_lora_float32", True), ("triton_lora_bfloat16", True)]
    greedy = [(r["cuda_graphs"], r["equal"]) for r in _where(records, check="lora_greedy")]
    assert greedy == [(True, True), (False, True)]
    (cost,) = _where(records, part="throughput")
    assert cost["adapters"] == 4 and cost["base_output_tokens_per_s"] > 0
    assert cost["slot_loads"] >= 4  # every adapter went into a slot
    assert "lora: tiny lora_greedy graphs=False equal=True prompts" in summary
    assert "4 adapters mixed" in summary
