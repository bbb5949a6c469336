"""pagedserve against transformers' continuous batching (`model.generate_batch`), same prompts,
same process, side by side:

    python -m bench.compare_transformers --num-prompts 64 --input-len 128 --output-len 64 \
        --dtypes float32 bfloat16 --json bench_results/compare.json

Both sample with temperature 1 (no top-k/top-p), ignore EOS and produce exactly output-len tokens
per prompt; both load the embedded SmolLM2 GGUF file. Each measurement runs in a fresh
subprocess, so neither engine's threads or allocator state can slow the other down.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.throughput import measure, random_token_prompts
from engine.model_source import resolve_model


def run_pagedserve(prompts: list[list[int]], output_len: int, dtype: str, model: str) -> float:
    from engine import LLM

    llm = LLM(model, device="cpu", dtype=dtype)
    result = measure(llm, prompts, output_len)
    assert result["num_output_tokens"] == len(prompts) * output_len
    return result["output_tokens_per_s"]


def run_transformers(prompts: list[list[int]], output_len: int, dtype: str, model: str) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = resolve_model(model).gguf_file
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    config = GenerationConfig(
        max_new_tokens=output_len,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf.generate_batch(
        prompts[:2],
        generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0
        ),
    )  # warm-up
    start = time.perf_counter()
    outs = hf.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outs.values())
    assert num_out == len(prompts) * output_len, num_out
    return num_out / elapsed


def _measure_in_subprocess(engine: str, dtype: str, args: argparse.Namespace) -> float:
    cmd = [
        sys.executable,
        "-m",
        "bench.compare_transformers",
        "--worker",
        engine,
        "--dtypes",
        dtype,
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--seed",
        str(args.seed),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--worker", choices=["pagedserve", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    vocab = resolve_model(args.model).config.vocab_size
    prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, args.seed, {2})
    if args.worker is not None:  # one measurement, printed as the last line
        run = run_pagedserve if args.worker == "pagedserve" else run_transformers
        print(run(prompts, args.output_len, args.dtypes[0], args.model))
        return

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        ours = _measure_in_subprocess("pagedserve", dtype, args)
        theirs = _measure_in_subprocess("transformers", dtype, args)
        row = {
            "dtype": dtype,
            "pagedserve_output_tok_s": round(ours, 1),
            "transformers_generate_batch_output_tok_s": round(theirs, 1),
            "ratio": round(ours / theirs, 2),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "workload": f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out",
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
