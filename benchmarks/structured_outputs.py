"""Structured outputs against free generation, side by side in one run, and grammar compile time.

python -m benchmarks.structured_outputs --num-prompts 64 --batch-size 16 --dtype bfloat16 \
    --repeats 2

Chat requests ask for a person as JSON; the constrained run samples (temperature 1, a seed per
request) under a JSON schema with nested objects, an enum, a bounded list and integer ranges.
The free run then generates exactly as many tokens per request (ignore_eos, max_tokens = that
request's constrained length), so both do the same model work and differ only by the grammar:
compiling, a matcher per sequence, one bitmask fill per step. The runs alternate (these
machines are noisy: compare within a run); reports output tokens per second of each and their
ratio, and the compile time of the schema (first, then cached) and of the vocabulary's
tokenizer info (once per engine). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedserve.engine import LLM, SamplingParams
from pagedserve.scheduler import StructuredOutputs

# A medium schema: a person with an address, an enum, a bounded list and integer ranges.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip_code": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip_code"],
        },
    },
    "required": ["name", "age", "size", "hobbies", "address"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="--max-num-seqs")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    llm = LLM(
        args.model, device="cpu", dtype=args.dtype, num_kv_blocks=2048,
        max_num_seqs=args.batch_size,
    )  # fmt: skip
    structured = llm.engine.core.structured
    spec = StructuredOutputs(json=PERSON_SCHEMA)
    start = time.perf_counter()
    structured._get_compiler()  # the vocabulary's tokenizer info, once per engine
    info_s = time.perf_counter() - start
    compile_s = []
    for _ in range(2):  # the first compiles; the second comes from xgrammar's cache
        start = time.perf_counter()
        structured.compile_now(spec)
        compile_s.append(time.perf_counter() - start)

    convs = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}]
        for i in range(args.num_prompts)
    ]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
        for i in range(args.num_prompts)
    ]
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    lengths: list[int] = []
    valid = 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.chat(convs, constrained)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_is_json_object(o.outputs[0].text) for o in outs)
        rates["constrained"].append(sum(lengths) / elapsed)
        free = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        start = time.perf_counter()
        outs = llm.chat(convs, free)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
        rates["free"].append(sum(lengths) / elapsed)
    free_rate = statistics.median(rates["free"])
    constrained_rate = statistics.median(rates["constrained"])
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "num_prompts": args.num_prompts,
                "batch_size": args.batch_size,
                "output_tokens": sum(lengths),
                "valid_json": f"{valid}/{args.num_prompts}",
                "free_tok_s": round(free_rate, 2),
                "constrained_tok_s": round(constrained_rate, 2),
                "ratio": round(constrained_rate / free_rate, 3),
                "runs_tok_s": {k: [round(r, 2) for r in v] for k, v in rates.items()},
                "tokenizer_info_s": round(info_s, 4),
                "compile_first_s": round(compile_s[0], 4),
                "compile_cached_s": round(compile_s[1], 6),
            }
        )
    )


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
