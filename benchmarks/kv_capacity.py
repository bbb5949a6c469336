"""KV capacity on CPU, side by side in one run (BENCHMARKS.md, "KV capacity: fp8 cache and swap
preemption"):

    python -m benchmarks.kv_capacity fp8 --repeats 3 --json bench_results/kv_fp8.json
    python -m benchmarks.kv_capacity swap --repeats 2 --json bench_results/kv_swap.json

fp8   `pagedserve bench throughput` (offline, bf16 weights) with the bf16 cache and with the fp8
      cache, each run in its own process, interleaved repeats, medians; plus what each plan holds
      at --max-model-len (blocks, max concurrency) under the default CPU budget.
swap  one `pagedserve serve` per preemption mode (recompute, swap) with a device pool of
      --num-kv-blocks, a quarter of what the workload's requests hold at once by default, and
      `pagedserve bench serve` against each in turn: throughput, TTFT and the preemption, swap-out
      and swap-in counts of /metrics. Both servers start first and wait idle while the other runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.options import add_int_options, flags
from pagedserve.bench import serve as bench_serve
from pagedserve.scheduler.utils import cdiv
from pagedserve.server.launch import server_process

PAGEDSERVE = str(Path(sys.executable).parent / "pagedserve")
BLOCK_SIZE = 16  # the servers' default


def _throughput(args: argparse.Namespace, kv_cache_dtype: str, seed: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            PAGEDSERVE, "bench", "throughput", "--model", args.model, "--dtype", args.dtype,
            "--kv-cache-dtype", kv_cache_dtype, "--max-model-len", str(args.max_model_len),
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--seed", str(seed), "--json", out.name,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True)
        return json.loads(Path(out.name).read_text())


def run_fp8(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for r in range(args.repeats):
        run = {kv: _throughput(args, kv, args.seed + r) for kv in ("auto", "fp8")}
        run["ratio"] = run["fp8"]["output_tokens_per_s"] / run["auto"]["output_tokens_per_s"]
        print(
            f"repeat {r}: bf16 cache {run['auto']['output_tokens_per_s']:.1f} tok/s, "
            f"fp8 cache {run['fp8']['output_tokens_per_s']:.1f} tok/s, ratio {run['ratio']:.3f}"
        )
        runs.append(run)
    last = runs[-1]
    return {
        "part": "fp8",
        "workload": vars(args) | {"func": None},
        "plans": {
            kv: {k: last[kv][k] for k in ("kv_cache_dtype", "kv_blocks", "max_concurrency")}
            for kv in ("auto", "fp8")
        },
        "median_output_tokens_per_s": {
            kv: statistics.median(run[kv]["output_tokens_per_s"] for run in runs)
            for kv in ("auto", "fp8")
        },
        "median_ratio": statistics.median(run["ratio"] for run in runs),
        "runs": runs,
    }


def _metrics(base: str) -> dict[str, float]:
    wanted = ("num_preemptions", "num_swap_outs", "num_swap_ins", "kv_host_blocks_used")
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        for name in wanted:
            if line.startswith((f"pagedserve_{name} ", f"pagedserve_{name}_total ")):
                values[name] = float(line.split()[1])
    return values


def run_swap(args: argparse.Namespace) -> dict[str, Any]:
    demand = args.num_prompts * cdiv(args.input_len + args.output_len, BLOCK_SIZE)
    num_blocks = args.num_kv_blocks or demand // 4
    print(f"the requests hold {demand} blocks at once; the pool has {num_blocks}")
    modes = {"recompute": [], "swap": ["--preemption-mode", "swap", "--swap-space", "4"]}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bases = {}
        for mode, extra in modes.items():
            serve_args = [
                "--model", args.model, "--dtype", args.dtype, "--no-access-log",
                "--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(num_blocks),
                *extra,
            ]  # fmt: skip
            log = Path(tempfile.gettempdir()) / f"kv_capacity_{os.getpid()}_{mode}.log"
            bases[mode] = base = stack.enter_context(server_process(serve_args, log))
            warm = [
                "--base-url", base, "--num-prompts", "2", "--seed", "1000000",
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            ]  # fmt: skip
            bench_serve.run(bench_serve.parse_args(warm))
        for r in range(args.repeats):
            run: dict[str, Any] = {}
            for mode, base in bases.items():
                before = _metrics(base)
                argv = flags(
                    base_url=base, num_prompts=args.num_prompts, input_len=args.input_len,
                    output_len=args.output_len, max_concurrency=args.num_prompts,
                    seed=args.seed + r,
                )  # fmt: skip
                result = bench_serve.run(bench_serve.parse_args(argv))
                after = _metrics(base)
                run[mode] = {
                    "output_throughput": result["output_throughput"],
                    "median_ttft_ms": result["median_ttft_ms"],
                    "p99_ttft_ms": result["p99_ttft_ms"],
                    "median_tpot_ms": result["median_tpot_ms"],
                    "completed": result["completed"],
                    # Counters as this run's increase; the host pool's gauge as it ends.
                    **{k: after[k] - before.get(k, 0) for k in after if k != "kv_host_blocks_used"},
                    "kv_host_blocks_used_after": after.get("kv_host_blocks_used"),
                }
            run["throughput_ratio"] = (
                run["swap"]["output_throughput"] / run["recompute"]["output_throughput"]
            )
            print(json.dumps(run))
            runs.append(run)
    return {
        "part": "swap",
        "workload": vars(args) | {"func": None, "num_kv_blocks": num_blocks, "demand": demand},
        "median": {
            mode: {
                key: statistics.median(run[mode][key] for run in runs)
                for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms")
            }
            for mode in modes
        },
        "median_throughput_ratio": statistics.median(run["throughput_ratio"] for run in runs),
        "runs": runs,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True)
    for name, func, prompts, input_len, output_len in (
        ("fp8", run_fp8, 64, 128, 64),
        ("swap", run_swap, 32, 256, 128),
    ):
        p = sub.add_parser(name)
        p.set_defaults(func=func)
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--dtype", default="bfloat16")
        add_int_options(
            p, max_model_len=2048, num_prompts=prompts, input_len=input_len,
            output_len=output_len, repeats=2, seed=0,
        )  # fmt: skip
        p.add_argument("--json", dest="json_path", default=None)
        if name == "swap":
            p.add_argument(
                "--num-kv-blocks", type=int, default=None,
                help="the servers' pool (default: a quarter of the blocks the requests hold)",
            )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
