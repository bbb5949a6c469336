"""HTTP serving against offline generation, same prompts, same run, side by side:

    python -m benchmarks.compare_serve --dtype bfloat16 --num-prompts 64 --input-len 128 \
        --output-len 64 --max-concurrency 16 --json bench_results/serve_vs_offline.json

1. offline: `LLM.generate` on all prompts at once (what `pagedserve bench throughput` does), and
   again with max_num_seqs = the client concurrency, which separates "HTTP costs" from "a smaller
   batch costs";
2. online: `pagedserve bench serve` at --max-concurrency against a `pagedserve serve` process per
   --server-modes entry: "core-process" (the engine core in a process of its own) and
   "in-process" (`--no-core-process`: the engine loop on the server's main thread). All servers
   start first and wait idle (no CPU) while another runs.

The runs are repeated --repeats times, interleaved, and medians are reported (this VM's speed
drifts by 10-20% over minutes). Within a repeat the same-batch offline run comes before and
after the servers' runs, and their mean is the baseline of that repeat's ratios. Every run uses
the prompts `bench serve` draws (random token ids, seed 0), greedy sampling, ignore_eos and
exactly output-len tokens per request.
Each offline run and the server live in their own process, so no run inherits another's threads
or allocator state.
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
import time
from pathlib import Path
from typing import Any

from benchmarks.options import add_int_options, flags
from pagedserve.bench import serve as bench_serve
from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.server.launch import server_process

LATENCY_KEYS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
)


def _offline_worker(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.engine import LLM, SamplingParams

    keep_large_allocations_in_heap()  # as `pagedserve serve` does
    prompts = bench_serve.random_token_ids(args.num_prompts, args.input_len, args.seed)
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up on other prompts (reversed), so the timed run gets no prefix-cache hits from it.
    llm.generate([p[::-1] for p in prompts[:2]], params.clone(max_tokens=2))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == args.num_prompts * args.output_len, num_out
    return {
        "max_num_seqs": args.max_num_seqs,
        "elapsed_s": round(elapsed, 3),
        "output_throughput": round(num_out / elapsed, 2),
    }


def _run_offline(args: argparse.Namespace, max_num_seqs: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.compare_serve", "--worker"]
    cmd += _common_args(args) + ["--max-num-seqs", str(max_num_seqs)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"offline run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _common_args(args: argparse.Namespace) -> list[str]:
    return flags(
        model=args.model, dtype=args.dtype, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
    )  # fmt: skip


def _run_online(args: argparse.Namespace, base: str, plot: str | None) -> dict[str, Any]:
    argv = flags(
        base_url=base, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, max_concurrency=args.max_concurrency, seed=args.seed,
        plot=plot or None,
    )  # fmt: skip
    return bench_serve.run(bench_serve.parse_args(argv))


SERVER_MODES = {"core-process": "--core-process", "in-process": "--no-core-process"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    add_int_options(
        p, num_prompts=64, input_len=128, output_len=64, max_concurrency=16, seed=0, port=8123,
        repeats=3,
    )  # fmt: skip
    p.add_argument(
        "--server-modes",
        default=",".join(SERVER_MODES),
        help=f"comma-separated, from {sorted(SERVER_MODES)}",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="bench serve's PNG for the online run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig().scheduler.max_num_seqs,
        help=argparse.SUPPRESS,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(_offline_worker(args)))
        return 0

    modes = args.server_modes.split(",")
    unknown = sorted(set(modes) - set(SERVER_MODES))
    if unknown:
        raise ValueError(f"--server-modes: unknown {unknown}; choose from {sorted(SERVER_MODES)}")
    # Interleaved repeats: this machine's speed drifts by 10-20% over minutes, so each ratio
    # compares runs made back to back, and the medians smooth the drift.
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        bases = {}
        for i, mode in enumerate(modes):
            serve_args = ["--model", args.model, "--dtype", args.dtype, "--no-access-log"]
            log = Path(tempfile.gettempdir()) / f"compare_serve_{os.getpid()}_{mode}.log"
            bases[mode] = base = stack.enter_context(
                server_process([*serve_args, SERVER_MODES[mode]], log, port=args.port + i)
            )
            # A short warm-up request so one-time costs are not timed (as offline).
            warm = ["--base-url", base, "--num-prompts", "2", "--seed", "1000000"]
            bench_serve.run(bench_serve.parse_args(warm))
        for r in range(args.repeats):
            # New prompts each repeat (seed + r): the servers keep their prefix caches between
            # repeats, and the same prompts again would skip their prefill.
            rep = argparse.Namespace(**{**vars(args), "seed": args.seed + r})
            run: dict[str, Any] = {"seed": rep.seed}
            run["offline"] = _run_offline(rep, EngineConfig().scheduler.max_num_seqs)[
                "output_throughput"
            ]
            before = _run_offline(rep, max_num_seqs=args.max_concurrency)["output_throughput"]
            for mode, base in bases.items():
                plot = f"{args.plot.removesuffix('.png')}_{mode}.png" if args.plot else None
                online = _run_online(rep, base, plot if r == args.repeats - 1 else None)
                run[mode] = {
                    "output_throughput": round(online["output_throughput"], 2),
                    "failed": online["failed"],
                    **{k: round(online[k], 2) for k in LATENCY_KEYS},
                }
            # The same-batch baseline is run before and after the servers and averaged: the
            # ratios then compare against the machine's speed around the online runs, not only
            # before them (it drifts within a repeat too).
            after = _run_offline(rep, max_num_seqs=args.max_concurrency)["output_throughput"]
            run["offline_same_batch_runs"] = [before, after]
            run["offline_same_batch"] = round((before + after) / 2, 2)
            runs.append(run)
            print(json.dumps(run), file=sys.stderr)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "max_concurrency": args.max_concurrency,
        "repeats": args.repeats,
        "median_offline_output_throughput": statistics.median(r["offline"] for r in runs),
        "median_offline_same_batch_output_throughput": statistics.median(
            r["offline_same_batch"] for r in runs
        ),
    }
    for mode in modes:
        online = [r[mode]["output_throughput"] for r in runs]
        result[mode] = {
            "median_output_throughput": statistics.median(online),
            "median_ratio_to_offline": round(
                statistics.median(o / r["offline"] for o, r in zip(online, runs, strict=True)), 3
            ),
            "median_ratio_to_offline_same_batch": round(
                statistics.median(
                    o / r["offline_same_batch"] for o, r in zip(online, runs, strict=True)
                ),
                3,
            ),
            **{k: statistics.median(r[mode][k] for r in runs) for k in LATENCY_KEYS},
        }
    result["runs"] = runs
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
