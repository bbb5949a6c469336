"""structured (optional): structured outputs on the device, constrained greedy tokens against
the CPU engine's, then a regex constraint's throughput against free generation."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import compare_tokens
from pagedserve.scheduler.utils import cdiv

# Structured outputs: one constraint of each kind for the tiny model's prompts (its synthetic
# tokenizer spells text with byte tokens, which is what the grammars match), and a long regex for
# the throughput run.
STRUCTURED_SPECS: dict[str, dict[str, Any]] = {
    "regex": {"regex": r"([a-z]{1,6} ){4,12}[a-z]{1,6}\."},
    "choice": {"choice": ["alpha", "beta", "gamma delta"]},
    "json": {
        "json": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 8},
                    "maxItems": 3,
                },
            },
            "required": ["id", "tags"],
        }
    },
    "grammar": {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
}
STRUCTURED_THROUGHPUT_REGEX = r"([a-z]{1,8} ){16,400}[a-z]{1,8}\."


def step_structured(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """Structured outputs on the device (xgrammar's Triton mask kernel, matchers on the host):
    the tiny Llama's fp32 constrained greedy tokens, one constraint of each kind, equal the CPU
    engine's (which equal transformers' masked by the same grammar,
    tests/engine/test_structured_outputs.py), graphs and eager; then the 1B shape, a regex
    constraint against free generation of the same token counts (the constrained engine steps
    synchronously, the free one with async scheduling)."""
    from pagedserve.engine import SamplingParams
    from pagedserve.scheduler import StructuredOutputs

    tiny, prompts = harness.tiny_llama_prompts(args.scratch, sizes)
    kinds = list(STRUCTURED_SPECS)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=2 * sizes.correctness_tokens,
            structured_outputs=StructuredOutputs(**STRUCTURED_SPECS[kinds[i % len(kinds)]]),
        )
        for i in range(len(prompts))
    ]
    max_model_len = 1024

    def constrained(device: str, eager: bool) -> tuple[list[list[int]], dict[str, Any]]:
        llm = harness.dummy_engine(
            tiny, device, "float32", [max_model_len] * len(prompts), max_model_len,
            enforce_eager=eager, max_num_seqs=len(prompts),
        )  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        info = {
            **harness.engine_info(llm),
            "live_matchers": len(llm.engine.core.structured.matchers),
        }
        del llm
        harness.free_memory()
        return tokens, info

    with rec.part(model="tiny", check="fp32_constrained_greedy"):
        expected, _ = constrained("cpu", True)
        for eager in (False, True):
            got, info = constrained(sizes.device, eager)
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_constrained_greedy",
                    "engine": "eager" if eager else "default",
                    "kinds": kinds,
                    **compare_tokens(expected, got),
                    **info,
                }
            )

    model = harness.model_path(args.model, args.scratch)
    num, input_len = sizes.offline_prompts, sizes.offline_input_len
    max_tokens = sizes.offline_output_len
    model_len = cdiv(input_len + max_tokens, 256) * 256
    spec = StructuredOutputs(regex=STRUCTURED_THROUGHPUT_REGEX)
    with rec.part(model=args.model, kind="throughput"), harness.reuse_dummy_weights():
        llm = harness.dummy_engine(
            model, sizes.device, sizes.dtype, [input_len + max_tokens] * num, model_len,
            max_num_seqs=num,
        )  # fmt: skip
        ids = harness.random_ids(num, input_len, llm.engine.core.model_config.vocab_size, 11)
        warm = SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)
        llm.generate(ids[:8], warm)  # compiles (grammar, Triton) out of the timed runs
        harness.sync(sizes.device)
        start = time.perf_counter()
        outs = llm.generate(
            ids, SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
        )
        harness.sync(sizes.device)
        constrained_s = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.generate(ids, free)
        harness.sync(sizes.device)
        free_s = time.perf_counter() - start
        total = sum(lengths)
        rec.write(
            {
                "model": args.model,
                "kind": "throughput",
                "dtype": sizes.dtype,
                "num_prompts": num,
                "input_len": input_len,
                "num_output_tokens": total,
                "constrained_tok_s": round(total / constrained_s, 1),
                "free_tok_s": round(total / free_s, 1),
                "ratio": round(free_s / constrained_s, 3),
                **harness.engine_info(llm),
            }
        )
