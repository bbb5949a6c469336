"""Quantized weights kept quantized on CPU (`--quantization gguf`) against the same GGUF file
dequantized to bfloat16 at load (`--quantization none`), on the embedded SmolLM2 Q4_1 file:

    python -m bench.quantized_cpu                   # both parts
    python -m bench.quantized_cpu --part matmul     # per-step matmul times by rows
    python -m bench.quantized_cpu --part agreement  # greedy agreement, 16 prompts x 64 tokens

matmul: the model's own weights (30 layers' q/k/v, o, gate/up, down and the lm_head), each
multiplied once by a [rows, K] activation, as one decode step of `rows` sequences does: torch's
int4/int8 kernels, pagedserve's compiled GEMM (kernels/csrc/cpu_quant.cpp) and oneDNN's packed
bfloat16 weights, side by side, milliseconds per step.

agreement: greedy continuations of both models for the same prompts: how many are identical,
their common prefix, and teacher-forced top-1 agreement (at each position of the dequantized
model's continuation, whether the kept model's most likely token is the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.cpu_linear import linear, pack
from engine.model_source import resolve_model
from engine.quantized_linear import QuantizedRows, QuantizedWeight, compiled_gemm
from engine.weights import iter_gguf_weights

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "The theory of relativity says that",
    "Translate to French: I like apples.",
    "import numpy as np\n",
    "A haiku about autumn:",
    "The best way to learn a language is",
    "Q: What is 12 times 7?\nA:",
    "Water boils at",
    "Dear hiring manager,",
    "The three laws of thermodynamics are",
    "In Python, a list comprehension",
    "The mitochondria is",
    "Steps to bake bread:",
]


STACKED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
           "up_proj": "gate_up"}  # fmt: skip


def _time(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def matmul_part(args: argparse.Namespace) -> list[dict]:
    source = resolve_model("smollm2-135m-instruct")
    fused: dict[str, list[QuantizedRows]] = {}  # stacked as the model stacks them
    for name, rows in iter_gguf_weights(
        source.gguf_file, source.config, progress=False, keep_quantized=True
    ):
        if isinstance(rows, QuantizedRows):
            stem, module = name.removesuffix(".weight").rsplit(".", 1)
            fused.setdefault(f"{stem}.{STACKED.get(module, module)}", []).append(rows)
    kept = [QuantizedWeight.build(QuantizedRows.cat(parts)) for parts in fused.values()]
    dense = []
    for weight in kept:
        param = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
        pack(param)
        dense.append(param)
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {w.in_features for w in kept}}
        outputs = {id(w): torch.empty(rows, w.out_features, dtype=torch.bfloat16) for w in kept}
        record = {"rows": rows, "weights": len(kept)}
        record["int_kernel_ms"] = _time(
            lambda inputs=inputs: [w._int_matmul(inputs[w.in_features]) for w in kept], args.iters
        )
        if compiled_gemm():
            record["compiled_gemm_ms"] = _time(
                lambda inputs=inputs, outputs=outputs: [
                    w._gemm(inputs[w.in_features], outputs[id(w)]) for w in kept
                ],
                args.iters,
            )
        record["dense_bf16_ms"] = _time(
            lambda inputs=inputs: [linear(inputs[d.shape[1]], d) for d in dense], args.iters
        )
        record["used_ms"] = _time(
            lambda inputs=inputs: [w.linear(inputs[w.in_features]) for w in kept], args.iters
        )
        results.append(record)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in record.items()}), flush=True)  # fmt: skip
    return results


def agreement_part(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    kw = dict(dtype="bfloat16", max_model_len=512)
    kept = LLM("smollm2-135m-instruct", quantization="gguf", **kw)
    dense = LLM("smollm2-135m-instruct", quantization="none", **kw)
    tokenizer = dense.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in kept.generate(prompts, params)]
    theirs = [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(n)
    # Teacher-forced: the kept model's top-1 along the dense model's continuations.
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    seqs = [p + t for p, t in zip(prompts, theirs, strict=True)]
    same = total = 0
    for prompt, seq, out in zip(prompts, seqs, kept.generate(seqs, forced), strict=True):
        for i in range(len(prompt), len(seq)):
            entry = out.prompt_logprobs[i]
            top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
            same += top == seq[i]
            total += 1
    record = {
        "prompts": len(prompts),
        "tokens": args.tokens,
        "identical_continuations": sum(n == args.tokens for n in prefixes),
        "mean_common_prefix": statistics.mean(prefixes),
        "teacher_forced_top1_agreement": same / total,
    }
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("matmul", "agreement", "all"), default="all")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("matmul", "all"):
        matmul_part(args)
    if args.part in ("agreement", "all"):
        agreement_part(args)


if __name__ == "__main__":
    main()
