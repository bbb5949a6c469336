"""`python -m benchmarks.gpu_kernels`: the arguments, the regular run over the scenarios,
the environment record and the summary table (the package's docstring describes the command)."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.attention import (
    FP8_KV,
    decode_label,
    prefill_label,
    run_decode,
    run_prefill,
)
from benchmarks.gpu_kernels.cache import cache_label, copy_label, run_cache, run_copy
from benchmarks.gpu_kernels.fused import FUSED_OPS, fused_label, run_fused
from benchmarks.gpu_kernels.invariance import format_invariance, run_invariance
from benchmarks.gpu_kernels.moe import moe_label, run_moe
from benchmarks.gpu_kernels.plans import FULL, SMOKE, Plan
from benchmarks.gpu_kernels.sweep import SWEEP_SCENARIOS, format_sweep, run_sweep

KERNELS_MODULE = "pagedserve.kernels.triton_attention"
SCENARIOS = ("decode", "prefill", "cache", "copy", "fused", "moe")
FUSED_KERNELS_MODULE = "pagedserve.kernels.triton_fused"
MOE_KERNELS_MODULE = "pagedserve.kernels.triton_moe"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def environment(setup: harness.Setup, smoke: bool) -> harness.Record:
    """What a reader needs to reproduce the numbers: hardware, versions, commit, settings."""
    device = setup.device
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "kind": "env",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if (status := _git("status", "--porcelain")) is None else bool(status),
        "kernels": setup.kernels.__name__,
        "fused_kernels": None if setup.fused_kernels is None else setup.fused_kernels.__name__,
        "moe_kernels": None if setup.moe_kernels is None else setup.moe_kernels.__name__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "smoke": smoke,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "block_size": harness.BLOCK_SIZE,
        "timer": (
            "perf_counter median"
            if device.type != "cuda"
            else "do_bench median" + (" of CUDA-graph replays" if setup.cuda_graph else "")
        ),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _git(*args: str) -> str | None:
    """Output of a git command in the repository, or None where git or the repository is missing
    (the GPU machine gets a copy of the working tree)."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def format_table(records: list[harness.Record]) -> str:
    """The measurements and a one-line verdict on the checks, for people."""
    row = "{:<8} {:<28} {:>10} {:>15} {:>15} {:>6} {:>6} {}"
    lines = [row.format("kind", "case", "time us", "ours", "baseline", "ratio", "target", "ok")]
    units = {
        "decode": ("gbps", "sdpa_gbps", "GB/s"),
        "prefill": ("tflops", "sdpa_tflops", "TF/s"),
        "cache": ("gbps", "ref_gbps", "GB/s"),
        "copy": ("gbps", "ref_gbps", "GB/s"),
        "fused": ("gbps", "ref_gbps", "GB/s"),
        "moe": ("tflops", "ref_tflops", "TF/s"),
    }
    for r in records:
        if r["kind"] not in units:
            continue
        ours, base, unit = units[r["kind"]]
        if r["kind"] == "decode" and r["kv_dtype"] == FP8_KV:
            base = "base_gbps"  # the kernel over the cache in --dtype
        lines.append(
            row.format(
                r["kind"],
                r["case"],
                f"{r['time_us']:.1f}",
                f"{r[ours]:.4g} {unit}",
                f"{r[base]:.4g} {unit}",
                f"{r['ratio']:.3g}",
                "" if r["target"] is None else f"{r['target']:.2f}",
                {None: "", True: "yes", False: "NO"}[r["ok"]],
            )
        )
        if r["kind"] == "fused":
            baseline = f"{r['model_gbps']:.4g} GB/s"
            model_ratio = f"{r['model_ratio']:.3g}"
            lines.append(row.format("", "  vs model", "", "", baseline, model_ratio, "", ""))
        if r["kind"] == "moe":
            baseline = f"{r['dense_tflops']:.4g} TF/s"
            dense_ratio = f"{r['dense_ratio']:.3g}"
            lines.append(row.format("", "  vs dense", "", "", baseline, dense_ratio, "", ""))
    checks = [r for r in records if r["kind"] == "check"]
    bad = [r["case"] for r in checks if not r["ok"]]
    errors = [r["max_abs_err"] for r in checks]
    worst = "non-finite" if None in errors else f"{max(errors, default=0.0):.4g}"
    lines.append(
        f"checks: {len(checks) - len(bad)}/{len(checks)} ok, max abs err {worst} (atol "
        f"{harness.ATOL}, rtol {harness.RTOL}; cache, copy exact; fused 2 ulps; moe atol, rtol)"
        + (f"; FAILED: {', '.join(bad)}" if bad else "")
    )
    lines += [f"error: {r['case']}: {r['error']}" for r in records if r["kind"] == "error"]
    lines.append(
        "baseline: SDPA on contiguous K/V (decode, prefill); the kernel over the --dtype cache "
        "(decode fp8: GB/s at 1 byte per element); torch reference (cache, copy, fused, "
        'moe; "vs model": the model\'s unfused torch code; "vs dense": the dense layer of the same '
        "active size)"
    )
    return "\n".join(lines)


def parse_scenarios(values: list[str] | None) -> list[str]:
    """`--only` values, repeated and/or comma-separated, in run order; all when none given."""
    if not values:
        return list(SCENARIOS)
    wanted = {v.strip() for value in values for v in value.split(",") if v.strip()}
    unknown = wanted - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    return [s for s in SCENARIOS if s in wanted]


def run_all(report: harness.Report, setup: harness.Setup, plan: Plan, scenarios: list[str]) -> None:
    """The regular run: every case of `plan` in `scenarios`, checked and then timed."""
    device = setup.device
    if "decode" in scenarios:
        for shape in plan.decode_shapes:
            for case in plan.decode_cases:
                checked = (shape, case.batch, case.context) == plan.window_case
                window = plan.sliding_window if checked else None
                fp8 = shape in plan.fp8_decode_shapes
                run = functools.partial(run_decode, report, setup, shape, case, window, fp8)
                harness.run_case(report, device, decode_label(shape, case), run)
    if "prefill" in scenarios:
        for shape in plan.prefill_shapes:
            for case in plan.prefill_cases:
                run = functools.partial(run_prefill, report, setup, shape, case)
                harness.run_case(report, device, prefill_label(shape, case), run)
    if "cache" in scenarios:
        shape, num_tokens = plan.cache_shape, plan.cache_tokens
        run = functools.partial(run_cache, report, setup, shape, num_tokens)
        harness.run_case(report, device, cache_label(shape, num_tokens), run)
    if "copy" in scenarios:
        shape, layers, pool = plan.copy_shape, plan.copy_layers, plan.copy_pool_blocks
        for n in plan.copy_counts:
            run = functools.partial(run_copy, report, setup, shape, layers, pool, n)
            harness.run_case(report, device, copy_label(shape, layers, pool, n), run)
    if "fused" in scenarios:
        for num_tokens in plan.fused_tokens:
            for op in FUSED_OPS:
                run = functools.partial(run_fused, report, setup, plan.fused_layer, op, num_tokens)
                harness.run_case(report, device, fused_label(plan.fused_layer, op, num_tokens), run)
    if "moe" in scenarios:
        for shape in plan.moe_shapes:
            for num_tokens in plan.moe_tokens:
                run = functools.partial(run_moe, report, setup, shape, num_tokens)
                harness.run_case(report, device, moe_label(shape, num_tokens), run)


def build_parser() -> argparse.ArgumentParser:
    # The package's docstring describes the command: its first paragraph is the description.
    package_doc = sys.modules[__package__].__doc__
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_kernels", description=package_doc.split("\n\n")[0]
    )
    parser.add_argument("--only", action="append", metavar="|".join(SCENARIOS))
    parser.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes; CPU too")
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="default bf16; fp16 for --smoke on CPU, as the Triton interpreter computes a bf16 "
        "tl.dot on raw bit patterns (triton-lang/triton#11584)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time attention as CUDA-graph replays, without host launch cost (the reference "
        "cache write syncs with the host and stays eager)",
    )
    parser.add_argument(
        "--kernels", default=KERNELS_MODULE, help=f"module under test (default {KERNELS_MODULE})"
    )
    parser.add_argument(
        "--fused-kernels",
        default=FUSED_KERNELS_MODULE,
        help=f"module of the fused ops under test (default {FUSED_KERNELS_MODULE})",
    )
    parser.add_argument(
        "--moe-kernels",
        default=MOE_KERNELS_MODULE,
        help=f"module of the fused MoE under test (default {MOE_KERNELS_MODULE})",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the regular cases, time the launch configurations of the decode and "
        "prefill kernels (tile, warps, stages, rows; decode splits) on a few cases against SDPA",
    )
    parser.add_argument(
        "--invariance",
        action="store_true",
        help="instead of the regular cases, check that the default paged attention gives a "
        "query the same bits in every batch composition, and time it against "
        "PAGEDSERVE_BATCH_VARIANT=1 (decode and prefill steps)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        scenarios = parse_scenarios(args.only)
    except ValueError as exc:
        parser.error(f"--only: {exc}")

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("warning: on CPU the Triton kernels need TRITON_INTERPRET=1", file=sys.stderr)
    else:
        print(
            "benchmarks.gpu_kernels: no CUDA device. The benchmark needs a GPU; to check the "
            "code path on CPU run: "
            "TRITON_INTERPRET=1 python -m benchmarks.gpu_kernels --smoke",
            file=sys.stderr,
        )
        return 2
    modules = {"kernels": args.kernels}
    if "fused" in scenarios:
        modules["fused"] = args.fused_kernels
    if "moe" in scenarios:
        modules["moe"] = args.moe_kernels
    try:
        loaded = {role: importlib.import_module(name) for role, name in modules.items()}
    except ImportError as exc:
        print(
            f"benchmarks.gpu_kernels: cannot import {exc.name or modules}: {exc}",
            file=sys.stderr,
        )
        return 2
    dtype_name = args.dtype or ("fp16" if device.type == "cpu" else "bf16")
    graph = args.cuda_graph and device.type == "cuda"
    setup = harness.Setup(
        loaded["kernels"], device, DTYPES[dtype_name], graph, loaded.get("fused"), loaded.get("moe")
    )

    plan = SMOKE if args.smoke else FULL
    sink = args.out.open("w") if args.out else None
    try:
        report = harness.Report(sink)
        report.emit(environment(setup, args.smoke))
        if args.invariance:
            run_invariance(report, setup, plan)
        elif args.sweep:
            swept = [s for s in scenarios if s in SWEEP_SCENARIOS]
            run = functools.partial(run_sweep, report, setup, plan, swept)
            harness.run_case(report, device, {"scenario": "sweep", "case": "sweep"}, run)
        else:
            run_all(report, setup, plan, scenarios)
    finally:
        if sink is not None:
            sink.close()
    print(format_table(report.records), file=sys.stderr)
    if args.invariance:
        print(format_invariance(report.records), file=sys.stderr)
    if args.sweep:
        print(format_sweep(report.records), file=sys.stderr)
    return 1 if report.failed else 0
