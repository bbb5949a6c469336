"""Offline throughput: random-token prompts with a fixed seed through the offline LLM API.

pagedserve bench throughput --model M --num-prompts 64 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from scheduler import SamplingParams


def random_token_prompts(
    num_prompts: int,
    input_len: int,
    vocab_size: int,
    seed: int,
    special_ids: set[int] | None = None,
) -> list[list[int]]:
    """Fixed-seed random prompts of exactly input_len ids, avoiding special tokens (ids < 1000 in
    most BPE vocabularies hold bytes and specials, so draw above them when the vocab allows)."""
    rng = random.Random(seed)
    low = 1000 if vocab_size > 2000 else 0
    special_ids = special_ids or set()
    prompts = []
    for _ in range(num_prompts):
        ids = []
        while len(ids) < input_len:
            t = rng.randrange(low, vocab_size)
            if t not in special_ids:
                ids.append(t)
        prompts.append(ids)
    return prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")


def measure(llm, prompts: list[list[int]], output_len: int, seed: int = 0) -> dict[str, Any]:
    """Time `llm.generate` on token-id prompts, each producing exactly output_len tokens."""
    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True, seed=seed
    )
    # A short warm-up so one-time costs (allocator, kernel selection) are not timed.
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
    preemptions_before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 2),
        "num_output_tokens": num_out,
        "num_preemptions": llm.engine.scheduler.num_preemptions - preemptions_before,
    }


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from engine import LLM

    llm = LLM(**engine_kwargs)
    engine = llm.engine
    prompts = random_token_prompts(
        args.num_prompts,
        args.input_len,
        engine.model_config.vocab_size,
        args.seed,
        set(engine.eos_token_ids),
    )
    result = {
        "model": engine_kwargs.get("model"),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **measure(llm, prompts, args.output_len, args.seed),
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s "
        f"({result['num_output_tokens']} output tokens in {result['elapsed_s']:.2f} s)"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
