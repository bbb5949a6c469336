"""pagedserve against transformers' continuous batching (`model.generate_batch`), same prompts,
same process, side by side:

    python -m bench.compare_transformers --num-prompts 64 --input-len 128 --output-len 64 \
        --dtypes float32 bfloat16 --json bench_results/compare.json

Both sample with temperature 1 (no top-k/top-p), ignore EOS and produce exactly output-len tokens
per prompt; both load the embedded SmolLM2 GGUF file.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.throughput import random_token_prompts
from engine.model_source import resolve_model


def run_pagedserve(prompts: list[list[int]], output_len: int, dtype: str, model: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype=dtype)
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    vocab = resolve_model(args.model).config.vocab_size
    prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, args.seed, {0, 1, 2})
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        ours = run_pagedserve(prompts, args.output_len, dtype, args.model)
        gc.collect()
        theirs = run_transformers(prompts, args.output_len, dtype, args.model)
        gc.collect()
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
