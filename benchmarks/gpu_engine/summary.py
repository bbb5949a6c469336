"""summary: a short text table of every step's records under --out (summary.txt)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_engine import harness


def _read(out: Path, step: str) -> list[dict[str, Any]]:
    path = out / f"{step}.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def summarize(out: Path) -> str:
    """A short text table of every record under `out` (missing steps say so)."""
    lines: list[str] = []
    env = _read(out, "env")
    if env:
        e = env[-1]
        lines.append(
            f"env: {e.get('gpu', 'no GPU')} | torch {e.get('torch')} | triton "
            f"{e.get('triton')} | transformers {e.get('transformers')} | commit {e.get('commit')}"
        )
    for step in harness.STEPS[1:-1]:
        records = _read(out, step)
        if not records and step in harness.OPTIONAL_STEPS:
            continue
        if not records:
            lines.append(f"{step}: no records")
            continue
        for r in records:
            if "error" in r:
                labels = {k: v for k, v in r.items() if k not in ("error", "trace", "step")}
                lines.append(f"{step}: ERROR {labels}: {r['error'][:300]}")
            else:
                try:
                    lines.append(f"{step}: " + _summary_line(step, r))
                except (KeyError, TypeError, ValueError):  # a record of another shape
                    lines.append(f"{step}: {json.dumps(r)[:400]}")
    return "\n".join(lines)


# The steps whose token checks (records with `num_equal_prompts`) read as `_token_check` alone, and
# what tells their two engines apart: the engine's name, or whether CUDA graphs ran.
TOKEN_CHECK_SETTING = {
    "moe": "engine", "structured": "engine", "tp": "engine",
    "embed": "cuda_graphs", "lora": "cuda_graphs",
}  # fmt: skip


def _summary_line(step: str, r: dict[str, Any]) -> str:
    if "num_equal_prompts" in r and step in TOKEN_CHECK_SETTING:
        if TOKEN_CHECK_SETTING[step] == "engine":
            return _token_check(r, r["model"], r["engine"])
        return _token_check(r, r["model"], f"graphs={r['cuda_graphs']}")
    if step == "correctness":
        if r.get("check") == "dummy_weights":
            return f"dummy weights drawn {r.get('draws')}x for {r.get('calls')} loads"
        margins = [m.get("reference_logit_margin") for m in r.get("mismatches", [])]
        return (
            _token_check(r, r["model"], r.get("engine", ""))
            + f" mean prefix match {r['mean_prefix_match']}/{r['num_tokens']}"
            + (f" margins at first difference {margins}" if margins else "")
        )
    if step == "decode":
        mode = "eager" if r.get("enforce_eager") else "graphs" if r.get("cuda_graphs") else "none"
        head = f"B={r.get('batch_size')} {mode}"
        if r.get("kind") == "step_time":
            return (
                f"{head} step {r['step_ms_median']} ms (roofline {r['roofline_ms']} ms, "
                f"{100 * r['fraction_of_roofline']:.0f}%), ctx {r['mean_context_len']}, "
                f"{r['output_tokens_per_s']} tok/s, pure decode {r['all_steps_pure_decode']}"
                + (
                    f", target {r['target_ms']} ms met {r['meets_target']}"
                    if "target_ms" in r
                    else ""
                )
            )
        if r.get("kind") == "cpu_split":
            return f"{head} host split {r['parts_ms']} other {r['step_other_ms']} ms"
        if r.get("kind") == "profile":
            top = ", ".join(
                f"{k['name'][:40]} {k['pct']}%" for k in (r.get("top_kernels") or [])[:3]
            )
            return (
                f"{head} profile wall {r['wall_ms_per_step']} ms/step, GPU busy "
                f"{r.get('gpu_busy_ms_per_step')} ms, gap {r.get('cpu_gap_ms_per_step')} ms; {top}"
            )
    if step == "moe":
        return (
            f"{r['model']} ({r['num_hidden_layers']} layers, {r['num_active_params']} of "
            f"{r['num_params']} parameters per token) {r.get('output_tokens_per_s')} output tok/s"
        )
    if step == "kvcap":
        if r.get("check") == "fp32_swap_greedy":
            return _token_check(r, r["model"], r["engine"]) + (
                f" swap outs/ins {r['swap_outs']}/{r['swap_ins']} of {r['preemptions']} preemptions"
            )
        if r.get("check"):
            return f"tiny fp8_greedy_agreement {r['agreement']}"
        return (
            f"{r['model']} {r['dtype']} cache {r['bf16_tok_s']} tok/s, fp8 cache "
            f"{r['fp8_tok_s']} tok/s ({r['ratio']}x)"
        )
    if step == "whisper":
        if r.get("kind") == "transcription":
            return (
                f"{r['model']} served c={r['concurrency']} x{r['requests']}: "
                f"{r['audio_s_per_s']} audio s/s, {r['output_tok_s']} tok/s, latency p50 "
                f"{r['latency_p50_s']} s"
            )
        return _summary_line("correctness", r)
    if step == "embed":
        if r.get("check") == "fp32_embeddings":
            return (
                f"{r['model']} fp32_embeddings {r['prompts']} prompts max |diff| "
                f"{r['max_abs_diff']:.2e} ok={r['ok']}"
            )
        return (
            f"{r['model']} {r['prompts']} prompts: {r['pagedserve_tok_s']:.0f} tok/s, "
            f"transformers {r['transformers_tok_s']:.0f} tok/s ({r['ratio']:.2f}x)"
        )
    if step == "lora":
        if r.get("check", "").startswith("triton_lora"):
            return (
                f"{r['check']} {r['tokens']} tokens max |diff| {r['max_abs_diff']:.2e} base rows "
                f"untouched={r['base_rows_untouched']} ok={r['ok']}"
            )
        return (
            f"{r['model']} {r['dtype']} {r['workload']}: base {r['base_output_tokens_per_s']} "
            f"tok/s, {r['adapters']} adapters mixed {r['mixed_output_tokens_per_s']} tok/s "
            f"({r['mixed_over_base']}x)"
        )
    if step == "tp":
        if r.get("skipped"):
            return f"tiny {r['check']} skipped: {r['skipped']}"
        return (
            f"{r['model']} {r['dtype']} plain {r['plain_tok_s']} tok/s, one rank through the "
            f"distributed path {r['tp1_tok_s']} tok/s ({r['ratio']}x; target >= 0.97)"
        )
    if step == "structured":
        return (
            f"{r['model']} {r['dtype']} regex {r['constrained_tok_s']} tok/s, free "
            f"{r['free_tok_s']} tok/s ({r['ratio']}x, {r['num_output_tokens']} tokens)"
        )
    if step == "offline":
        if r.get("kind") == "engine":
            return (
                f"{r['engine']} {r['output_tokens_per_s']} output tok/s ({r['num_prompts']} "
                f"requests, {r['num_output_tokens']} tokens in {r['elapsed_s']} s)"
            )
        return (
            f"{r.get('dtype')} pagedserve {r.get('pagedserve_output_tok_s')} tok/s | "
            f"generate_batch {r.get('transformers_generate_batch_output_tok_s')} "
            f"({r.get('ratio')}x) | generate {r.get('transformers_generate_output_tok_s')} "
            f"({r.get('ratio_vs_static')}x)"
        )
    if step == "nano":
        return (
            f"{r['model']} {r['output_tokens_per_s']} output tok/s, {r['total_tokens_per_s']} "
            f"total tok/s, {r['num_output_tokens']} tokens in {r['elapsed_s']} s, exact "
            f"{r['exact_output_tokens']}, preemptions {r['num_preemptions']}"
            + (f", vs vLLM A800 {r['ratio_vs_vllm_a800']}x" if "ratio_vs_vllm_a800" in r else "")
        )
    if step == "spec":
        if r.get("kind") == "dummy_weights":
            return f"dummy weights drawn {r.get('draws')}x for {r.get('calls')} loads"
        if r.get("kind") == "shared_blocks":
            return (
                f"n={r['n']} on shared blocks = {r['n']} seeded requests {r['same_tokens']} "
                f"({r['num_distinct_samples']} distinct samples), block copies "
                f"{r['num_block_copies']}, blocks used at the end {r['num_used_blocks_end']}"
            )
        return (
            f"B={r['batch_size']} plain {r['plain_tok_s']} tok/s, ngram {r['spec_tok_s']} tok/s "
            f"({r['speedup']}x, steps {r['plain_steps']} -> {r['spec_steps']}), accepted "
            f"{r['accepted_tokens']}/{r['draft_tokens']} drafts, same tokens {r['same_tokens']} "
            f"({r['num_equal_prompts']}/{r['num_prompts']} prompts, {r['num_output_tokens']} "
            "tokens)"
        )
    if step == "online":
        if r.get("kind") == "offline":
            return f"offline {r['num_prompts']} requests {r['output_throughput']} tok/s"
        return (
            f"c={r['max_concurrency']} n={r['num_requests']} {r['output_throughput']:.1f} tok/s "
            f"TTFT p50/p99 {r['median_ttft_ms']:.1f}/{r['p99_ttft_ms']:.1f} ms TPOT p50 "
            f"{_num(r['median_tpot_ms'])} ITL p50/p99 {_num(r['median_itl_ms'])}/"
            f"{_num(r['p99_itl_ms'])} ms, client CPU {r['client_cpu_fraction']}"
            + (
                f", online/offline {r['ratio_online_to_offline']} (target "
                f"{r['target_ratio']}: {r['meets_target']})"
                if "ratio_online_to_offline" in r
                else ""
            )
        )
    return json.dumps(r)[:300]


def _token_check(r: dict[str, Any], model: str, setting: str) -> str:
    """A check of an engine's tokens against a reference: which, how set up, how many equal."""
    return (
        f"{model} {r['check']} {setting} equal={r['equal']} prompts "
        f"{r['num_equal_prompts']}/{r['num_prompts']}"
    )


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
