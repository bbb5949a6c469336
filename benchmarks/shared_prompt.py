"""n samples of one long prompt against n separate requests: KV blocks and tokens computed.

python -m benchmarks.shared_prompt --num-samples 8 --prompt-len 1024 --output-len 32

One request with n samples shares the prompt's blocks (the samples fork the first one's blocks,
the partial last one included, and copy that one when they first write into it). n separate
requests of the same prompt share only what the prefix cache finds: its whole blocks, once the
first request has allocated them; without the prefix cache they share nothing. Each run reports
the peak number of KV blocks in use, the tokens the model computed (prefill and decode) and the
time; prints one JSON object per arrangement.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from benchmarks.options import add_int_options
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    scheduler = engine.core.scheduler
    kv = scheduler.kv_cache_manager
    computed, peak = 0, 0
    schedule = scheduler.schedule

    def counting_schedule():
        nonlocal computed
        out = schedule()
        computed += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counting_schedule
    copies = kv.num_block_copies
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    start = time.perf_counter()
    outputs = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, kv.num_used_blocks)
    elapsed = time.perf_counter() - start
    scheduler.schedule = schedule
    return {
        "peak_kv_blocks": peak,
        "tokens_computed": computed,
        "output_tokens": outputs,
        "block_copies": kv.num_block_copies - copies,
        "seconds": round(elapsed, 2),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    add_int_options(parser, num_samples=8, prompt_len=1024, output_len=32)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=args.output_len, ignore_eos=True, n=args.num_samples
    )
    separate = [(prompt, params.clone(n=1, seed=5 + k)) for k in range(args.num_samples)]
    common = dict(model=args.model, device="cpu", dtype=args.dtype, num_kv_blocks=2048)
    for name, prefix_caching, requests in (
        ("one request, n samples", True, [(prompt, params)]),
        ("separate requests, prefix cache", True, separate),
        ("separate requests, no prefix cache", False, separate),
    ):
        engine = LLMEngine(EngineConfig(**common, enable_prefix_caching=prefix_caching))
        result = run(engine, requests)
        print(json.dumps({"arrangement": name, "num_samples": args.num_samples,
                          "prompt_len": args.prompt_len, **result}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
