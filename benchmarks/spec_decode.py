"""Speculative decoding by prompt lookup against plain decoding, side by side in one run.

python -m benchmarks.spec_decode --batch-sizes 1 16 --output-len 128 --repeats 3

The workload is one where the output repeats the prompt, as in code edits or "repeat this text":
chat requests asking the model to repeat a passage exactly, greedy. Each repeat runs the plain
engine and the speculative one on the same requests, alternately (these machines are noisy:
compare within a run). Reports output tokens per second of each, their ratio, and the share of
drafts accepted; prints one JSON object per batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.options import add_int_options
from pagedserve.engine import LLM, SamplingParams

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])",
    "Roses are red, violets are blue, sugar is sweet, and so are you. The rose is red, the "
    "violet is blue, the honey is sweet, and so are you.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
    "slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
]


def conversations(batch_size: int) -> list[list[dict[str, str]]]:
    return [
        [
            {
                "role": "user",
                "content": "Repeat this text exactly, with nothing before or after it:\n\n"
                + PASSAGES[i % len(PASSAGES)],
            }
        ]
        for i in range(batch_size)
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    add_int_options(parser, output_len=128, num_speculative_tokens=4, repeats=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    common = dict(model=args.model, device="cpu", dtype=args.dtype, num_kv_blocks=1024)
    engines = {
        "plain": LLM(**common),
        "speculative": LLM(**common, speculative_ngram=args.num_speculative_tokens),
    }
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    for batch_size in args.batch_sizes:
        convs = conversations(batch_size)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        outputs: dict[str, list[list[int]]] = {}
        spec_stats = engines["speculative"].engine.core.scheduler
        drafted, accepted = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
        for _ in range(args.repeats):
            for name, llm in engines.items():
                start = time.perf_counter()
                result = llm.chat(convs, params)
                elapsed = time.perf_counter() - start
                outputs[name] = [o.outputs[0].token_ids for o in result]
                rates[name].append(sum(len(t) for t in outputs[name]) / elapsed)
        plain, spec = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
        drafted = spec_stats.num_draft_tokens - drafted
        accepted = spec_stats.num_accepted_tokens - accepted
        print(
            json.dumps(
                {
                    "batch_size": batch_size,
                    "output_tokens": sum(len(t) for t in outputs["plain"]),
                    "plain_tok_s": round(plain, 1),
                    "speculative_tok_s": round(spec, 1),
                    "speedup": round(spec / plain, 2),
                    "drafted": drafted,
                    "accepted": accepted,
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "same_tokens": outputs["plain"] == outputs["speculative"],
                    "plain_runs": [round(r, 1) for r in rates["plain"]],
                    "speculative_runs": [round(r, 1) for r in rates["speculative"]],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
