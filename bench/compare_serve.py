"""HTTP serving against offline generation, same prompts, same run, side by side:

    python -m bench.compare_serve --dtype bfloat16 --num-prompts 64 --input-len 128 \
        --output-len 64 --max-concurrency 16 --json bench_results/serve_vs_offline.json

1. offline: `LLM.generate` on all prompts at once (what `pagedserve bench throughput` does), and
   again with max_num_seqs = the client concurrency, which separates "HTTP costs" from "a smaller
   batch costs";
2. online: a `pagedserve serve` process and `pagedserve bench serve` at --max-concurrency.

Every run uses the prompts `bench serve` draws (random token ids, seed 0), greedy sampling,
ignore_eos and exactly output-len tokens per request. Each offline run and the server live in
their own process, so no run inherits another's threads or allocator state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import serve as bench_serve


def _offline_worker(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams

    prompts = bench_serve.random_token_ids(args.num_prompts, args.input_len, args.seed)
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params.clone(max_tokens=2))  # warm-up, as bench throughput does
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
    cmd = [sys.executable, "-m", "bench.compare_serve", "--worker"]
    cmd += _common_args(args) + ["--max-num-seqs", str(max_num_seqs)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"offline run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _common_args(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model,
        "--dtype", args.dtype,
        "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--seed", str(args.seed),
    ]  # fmt: skip


def _run_online(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model]
    cmd += ["--dtype", args.dtype, "--port", str(port), "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in 300 s")
            time.sleep(0.5)
        parser = argparse.ArgumentParser()
        bench_serve.add_arguments(parser)
        bench_args = parser.parse_args(
            [
                "--base-url", base,
                "--num-prompts", str(args.num_prompts),
                "--input-len", str(args.input_len),
                "--output-len", str(args.output_len),
                "--max-concurrency", str(args.max_concurrency),
                "--seed", str(args.seed),
            ]
            + (["--plot", args.plot] if args.plot else [])
        )  # fmt: skip
        # A short warm-up request so one-time costs are not in the timed run (as offline).
        bench_serve.run(
            parser.parse_args(["--base-url", base, "--num-prompts", "2", "--output-len", "2"])
        )
        return bench_serve.run(bench_args)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="bench serve's PNG for the online run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-num-seqs", type=int, default=256, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_offline_worker(args)))
        return 0

    offline_all = _run_offline(args, max_num_seqs=256)
    offline_capped = _run_offline(args, max_num_seqs=args.max_concurrency)
    online = _run_online(args)
    keys = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    keys += ("median_itl_ms", "p99_itl_ms", "median_e2el_ms")
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "max_concurrency": args.max_concurrency,
        "offline_output_throughput": offline_all["output_throughput"],
        f"offline_max_num_seqs_{args.max_concurrency}_output_throughput": offline_capped[
            "output_throughput"
        ],
        "online_output_throughput": round(online["output_throughput"], 2),
        "online_failed": online["failed"],
        "ratio_online_to_offline": round(
            online["output_throughput"] / offline_all["output_throughput"], 3
        ),
        "ratio_online_to_offline_same_batch": round(
            online["output_throughput"] / offline_capped["output_throughput"], 3
        ),
        **{k: online[k] for k in keys},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
