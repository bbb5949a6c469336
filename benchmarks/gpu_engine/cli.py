"""The engine on an H200: correctness, decode step time, profile, offline and online
throughput, speculative decoding and shared blocks, as steps of one script.
`benchmarks/gpu_engine.sh` runs them in order, each under its own time limit.

`python -m benchmarks.gpu_engine STEP`, STEP one of:

    env          versions, GPU, commit
    correctness  greedy tokens against transformers' (fp32 exact, bf16
                 counted), CUDA graphs against eager
    decode       decode step time at batch 1 and 256 with ~1k context,
                 graphs and eager, against the memory roofline; the
                 host-time split of a step; a profiler summary
    offline      pagedserve against transformers' generate_batch and
                 generate (bench.compare_transformers)
    nano --model M   nano-vllm's workload (`pagedserve bench throughput`)
    online       `pagedserve serve` + `pagedserve bench serve` at
                 concurrency 1, 64 and 256, and offline on the same
                 requests
    spec         speculative decoding by prompt lookup against plain
                 decoding (speed, acceptance, equal greedy tokens);
                 n = 4 samples on shared blocks against 4 requests
    embed        (optional) a BERT encoder's embeddings against
                 transformers', and their speed; the token rules
                 (logit_bias, allowed_token_ids, min_tokens) against
                 the CPU engine
    lora         (optional) the Triton LoRA kernels against the
                 reference; greedy tokens with mixed adapters against
                 the CPU engine; 4 adapters mixed against the base
    summary      a table of everything under --out

Each step appends JSON lines to OUT/<step>.jsonl (and prints them); OUT is --out, else $OUT,
else docs/results/gpu_engine. A part that fails writes a record with "error" and the step goes
on with the next part (exit status 1 at the end).

--smoke runs the same code on the CPU with a tiny Llama config and tiny sizes, so that the GPU
minutes go to measuring, not debugging (tests/bench/test_gpu_engine_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import step_correctness
from benchmarks.gpu_engine.decode import step_decode
from benchmarks.gpu_engine.embed import step_embed
from benchmarks.gpu_engine.env import step_env
from benchmarks.gpu_engine.kvcap import step_kvcap
from benchmarks.gpu_engine.lora import step_lora
from benchmarks.gpu_engine.moe import step_moe
from benchmarks.gpu_engine.nano import step_nano
from benchmarks.gpu_engine.offline import step_offline
from benchmarks.gpu_engine.online import offline_serve_worker, step_online
from benchmarks.gpu_engine.spec import step_spec
from benchmarks.gpu_engine.structured import step_structured
from benchmarks.gpu_engine.summary import summarize
from benchmarks.gpu_engine.tp import step_tp
from benchmarks.gpu_engine.whisper import step_whisper


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # `timeout` sends SIGTERM: unwind, so that finally blocks stop the server and the workers.
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_engine",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("step", choices=[*harness.STEPS, "offline-serve-worker"])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, tiny sizes")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON lines")
    p.add_argument("--model", default=None, help="default: llama-3.2-1b (tiny with --smoke)")
    # offline-serve-worker only
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--num-prompts", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--input-len", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--output-len", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-cache-gib", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.step == "offline-serve-worker":
        print(json.dumps(offline_serve_worker(args)))
        return 0
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    args.out = args.out or Path(os.environ.get("OUT") or harness.REPO / "docs/results/gpu_engine")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        text = summarize(args.out)
        (args.out / "summary.txt").write_text(text + "\n")
        print(text)
        return 0
    sizes = harness.SMOKE_SIZES if args.smoke else harness.GPU_SIZES
    if args.model is None or args.smoke and args.step != "nano":
        args.model = harness.TINY if args.smoke else "llama-3.2-1b"
    rec = harness.Recorder(args.out, args.step, args.smoke)
    steps = {
        "env": step_env,
        "correctness": step_correctness,
        "decode": step_decode,
        "offline": step_offline,
        "nano": step_nano,
        "online": step_online,
        "spec": step_spec,
        "moe": step_moe,
        "structured": step_structured,
        "kvcap": step_kvcap,
        "tp": step_tp,
        "whisper": step_whisper,
        "embed": step_embed,
        "lora": step_lora,
    }
    with tempfile.TemporaryDirectory(prefix="gpu_engine_") as scratch:
        args.scratch = Path(scratch)
        start = time.perf_counter()
        with rec.part(part="step"):
            steps[args.step](args, rec, sizes)
        print(f"{args.step}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 1 if rec.num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
