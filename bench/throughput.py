"""Offline throughput: random-token prompts with a fixed seed through the offline LLM API.

pagedserve bench throughput --model M --num-prompts 64 --input-len 128 --output-len 64

With --input-len-range / --output-len-range every request draws its own lengths the way
nano-vllm's bench.py does; nano-vllm's own workload is

pagedserve bench throughput --model M --num-prompts 256 --input-len-range 100 1024 \
    --output-len-range 100 1024 --dataset-seed 0 --temperature 0.6 --no-request-seeds

(142,827 prompt tokens, 133,966 output tokens). Its "Throughput" is output tokens / time, our
output_tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.engine import LLM
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.scheduler import SamplingParams


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


# nano-vllm's bench.py draws prompt ids with randint(0, 10000) (both ends included).
RANGE_TOKEN_ID_HIGH = 10000


def random_length_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    """Prompts and per-request output lengths drawn as nano-vllm's bench.py draws them.

    With `random.Random(seed)`: for each prompt its length randint(*input_len_range), then its
    ids randint(0, 10000) (capped to the vocabulary); after all prompts, one
    randint(*output_len_range) per request. Seed 0, 256 prompts and both ranges (100, 1024)
    give nano-vllm's exact workload: 142,827 prompt tokens and 133,966 output tokens.
    """
    rng = random.Random(seed)
    high = min(RANGE_TOKEN_ID_HIGH, vocab_size - 1)
    # The range() is evaluated before its ids are drawn, as in nano-vllm's list comprehension.
    prompts = [
        [rng.randint(0, high) for _ in range(rng.randint(*input_len_range))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    return prompts, output_lens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    ranges = {
        "--input-len-range": "draw each prompt's length uniformly from [LO, HI] (nano-vllm's "
        "workload; ids in [0, 10000]); --input-len is then unused",
        "--output-len-range": "draw each request's max_tokens uniformly from [LO, HI]; "
        "--output-len is then unused",
    }
    for flag, help_text in ranges.items():
        parser.add_argument(
            flag, type=int, nargs=2, metavar=("LO", "HI"), default=None, help=help_text
        )
    parser.add_argument(
        "--dataset-seed",
        type=int,
        default=None,
        help="seed of the prompts and lengths (default: --seed)",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (nano-vllm: 0.6)"
    )
    parser.add_argument(
        "--no-request-seeds",
        action="store_true",
        help="send requests without a seed of their own, as vLLM's and nano-vllm's benchmarks do "
        "(the engine's --seed still fixes the run); by default each carries --seed, which costs "
        "the sampler a host-side generator per row and step",
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")


def _check_range(name: str, value: Sequence[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    lo, hi = value
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} needs 1 <= LO <= HI, got {lo} {hi}")
    return lo, hi


def build_workload(
    args: argparse.Namespace, vocab_size: int, special_ids: set[int]
) -> tuple[list[list[int]], list[int]]:
    """The prompts and per-request output lengths that `args` describe."""
    seed = args.seed if getattr(args, "dataset_seed", None) is None else args.dataset_seed
    input_range = _check_range("--input-len-range", getattr(args, "input_len_range", None))
    output_range = _check_range("--output-len-range", getattr(args, "output_len_range", None))
    if input_range is None and output_range is None:
        prompts = random_token_prompts(
            args.num_prompts, args.input_len, vocab_size, seed, special_ids
        )
        return prompts, [args.output_len] * args.num_prompts
    return random_length_workload(
        args.num_prompts,
        input_range or (args.input_len, args.input_len),
        output_range or (args.output_len, args.output_len),
        vocab_size,
        seed,
    )


def measure(
    llm,
    prompts: list[list[int]],
    output_len: int | Sequence[int],
    seed: int | None = 0,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Time `llm.generate` on token-id prompts; request i produces exactly output_len tokens, or
    output_len[i] when a sequence is given (ignore_eos). Every request carries `seed`; None
    sends them unseeded (drawn from the engine's own seeded stream)."""
    output_lens = [output_len] * len(prompts) if isinstance(output_len, int) else list(output_len)
    if len(output_lens) != len(prompts):
        raise ValueError(f"{len(output_lens)} output lengths for {len(prompts)} prompts")
    params = [
        SamplingParams(temperature=temperature, top_p=1.0, max_tokens=n, ignore_eos=True, seed=seed)
        for n in output_lens
    ]
    # A short warm-up so one-time costs (allocator, kernel selection) are not timed. Reversed
    # prompts: the timed run must not find them in the prefix cache. On CUDA a batch of 1, 16
    # and 17 too: Triton compiles a kernel again for integer arguments equal to 1 or divisible
    # by 16, and that compile must not land in the timed run.
    warm_sizes = [2] if llm.engine.core.worker.device.type == "cpu" else [1, 16, 17]
    for size in warm_sizes:
        warm = [p[::-1] for p in prompts[:size]]
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    preemptions_before = llm.engine.core.scheduler.num_preemptions
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
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "expected_output_tokens": sum(output_lens),
        "num_preemptions": llm.engine.core.scheduler.num_preemptions - preemptions_before,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`pagedserve bench throughput`: the engine flags of `args` (EngineConfig's) and the
    workload flags of `add_arguments`."""
    config = EngineConfig.from_cli_args(args)
    llm = LLM.from_config(config)
    engine = llm.engine
    prompts, output_lens = build_workload(
        args, engine.core.model_config.vocab_size, set(engine.core.eos_token_ids)
    )
    ranged = args.input_len_range is not None or args.output_len_range is not None
    result = {
        "model": config.model.model,
        "dtype": str(engine.core.worker.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.core.worker.kv_cache_dtype).removeprefix("torch."),
        "kv_blocks": engine.core.worker.kv_plan.num_blocks,
        "max_model_len": engine.max_model_len,
        "max_concurrency": round(engine.core.worker.kv_plan.max_concurrency, 2),
        "device": str(engine.core.worker.device),
        "num_prompts": args.num_prompts,
        "input_len": None if args.input_len_range else args.input_len,
        "output_len": None if args.output_len_range else args.output_len,
        "input_len_range": args.input_len_range,
        "output_len_range": args.output_len_range,
        "dataset_seed": args.seed if args.dataset_seed is None else args.dataset_seed,
        "workload": "nano-vllm random lengths" if ranged else "fixed lengths",
        "temperature": args.temperature,
        "request_seed": None if args.no_request_seeds else args.seed,
        **measure(
            llm,
            prompts,
            output_lens,
            None if args.no_request_seeds else args.seed,
            args.temperature,
        ),
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
