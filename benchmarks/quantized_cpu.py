"""Quantized weights kept as the GGUF file's blocks (`--quantization gguf`) against the same file
dequantized at load (`--quantization none`), on the embedded SmolLM2 Q4_1 file or `--model` (a
GGUF file's path: a Q4_K_M one, say), in `--dtype` (float32 or bfloat16):

    python -m benchmarks.quantized_cpu                   # all three parts
    python -m benchmarks.quantized_cpu --part matmul     # per-step matmul times by rows
    python -m benchmarks.quantized_cpu --part agreement  # greedy agreement, 16 x 64 tokens
    python -m benchmarks.quantized_cpu --part step       # decode step, 1 and 64 sequences

matmul: the model's own weights (30 layers' q/k/v, o, gate/up, down and the lm_head), each
multiplied once by a [rows, K] activation, as one decode step of `rows` sequences does: the block
dot products (kernels/csrc/cpu_gguf.cpp), in bfloat16 with AMX the AMX tiles of weights
dequantized in cache, the weights dequantized per step and multiplied dense, what
`BlockWeight.linear` picks, and the dense weights of the dtype (packed for oneDNN where the
CPU lets it: `dense_packed`; else F.linear, as the engine does there), side by side,
milliseconds per step.

step: decode steps of the engine with each kind of weights (`--batch` sequences of 8 prompt
tokens, 64 new tokens each, so nearly every step decodes all of them): milliseconds per step in
the layers' matmuls, the lm_head, paged attention and the rest, run layer by layer
(`--enforce-eager`); and for the kept weights also as one compiled call per step
(engine/models/compiled_step.py), whose time is `compiled_ms` (layers, attention and all).

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

from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap
from pagedserve.engine.frontend.outputs import greedy_top
from pagedserve.engine.models import quantized_linear
from pagedserve.engine.models.cpu_linear import linear, pack
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.engine.models.quantized_linear import (
    BlockWeight,
    QuantizedRows,
    amx_tiles,
    block_dot_isa,
    block_ops,
)
from pagedserve.engine.models.weights import iter_gguf_weights

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
    source = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    fused: dict[str, list[QuantizedRows]] = {}  # stacked as the model stacks them
    for name, rows in iter_gguf_weights(
        source.gguf_file, source.config, progress=False, keep_quantized=True
    ):
        if isinstance(rows, QuantizedRows):
            stem, module = name.removesuffix(".weight").rsplit(".", 1)
            fused.setdefault(f"{stem}.{STACKED.get(module, module)}", []).append(rows)
    kept = [BlockWeight(QuantizedRows.stack(parts)) for parts in fused.values()]
    dense, packed = [], True
    for weight in kept:
        param = torch.nn.Parameter(weight.dequantize(dtype), requires_grad=False)
        packed = pack(param)  # False for bf16 on AVX2-only CPUs: oneDNN has no bf16 kernels
        dense.append(param)
    # Each kept route by its op (x, blocks, qtype, out), over every part of every weight.
    routes = {"block_dot_ms": block_ops().gguf_block_linear} if block_dot_isa() else {}
    if dtype == torch.bfloat16 and amx_tiles():
        routes["amx_ms"] = block_ops().gguf_amx_linear
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {w.in_features for w in kept}}
        outputs = {id(p): torch.empty(rows, p.shape[0], dtype=dtype) for w in kept for p in w.parts}
        record = {"dtype": args.dtype, "rows": rows, "weights": len(kept)}
        for key, op in routes.items():
            record[key] = _time(
                lambda inputs=inputs, outputs=outputs, op=op: [
                    op(inputs[w.in_features], p.blocks, p.kernel_type, outputs[id(p)])
                    for w in kept
                    for p in w.parts
                ],
                args.iters,
            )
        record["dequantized_dense_ms"] = _time(
            lambda inputs=inputs: [w._dense_linear(inputs[w.in_features]) for w in kept],
            args.iters,
        )
        record["used_ms"] = _time(
            lambda inputs=inputs: [w.linear(inputs[w.in_features]) for w in kept], args.iters
        )
        record["dense_packed"] = packed
        record["dense_ms"] = _time(
            lambda inputs=inputs: [linear(inputs[d.shape[1]], d) for d in dense], args.iters
        )
        results.append(record)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in record.items()}), flush=True)  # fmt: skip
    return results


def _timed(fn, spent: dict[str, float], part_of):
    """`fn`, adding its wall time to spent[part_of(args)]."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part_of(args)] += time.perf_counter() - start

    return wrapper


def step_part(args: argparse.Namespace) -> list[dict]:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.models import model as engine_model
    from pagedserve.engine.models.compiled_step import CompiledStep
    from pagedserve.kernels import cpu_ops

    results = []
    for quantization, eager in (("gguf", False), ("gguf", True), ("none", True)):
        llm = LLM(args.model, quantization=quantization, dtype=args.dtype, enforce_eager=eager)
        lm_head = llm.engine.core.worker.model.matmul_weights()[-1]
        spent = dict.fromkeys(("matmuls", "lm_head", "attention", "compiled"), 0.0)
        linear_fn, attention_fn = engine_model.linear, cpu_ops.paged_attention
        compiled_fn = CompiledStep.__call__

        engine_model.linear = _timed(
            linear_fn, spent, lambda a, head=lm_head: "lm_head" if a[1] is head else "matmuls"
        )
        cpu_ops.paged_attention = _timed(attention_fn, spent, lambda a: "attention")
        CompiledStep.__call__ = _timed(compiled_fn, spent, lambda a: "compiled")
        try:
            for batch in args.batch:
                prompts = [[100 + i + j for j in range(8)] for i in range(batch)]
                params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
                llm.generate(prompts, params)  # warm-up
                for key in spent:
                    spent[key] = 0.0
                start = time.perf_counter()
                llm.generate(prompts, params)
                total = (time.perf_counter() - start) * 1e3 / 64
                record = {"quantization": quantization, "eager": eager, "dtype": args.dtype,
                          "batch": batch, "step_ms": total}  # fmt: skip
                record.update({f"{k}_ms": v * 1e3 / 64 for k, v in spent.items()})
                record["rest_ms"] = total - sum(v * 1e3 / 64 for v in spent.values())
                results.append(record)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in record.items()}), flush=True)  # fmt: skip
        finally:
            engine_model.linear, cpu_ops.paged_attention = linear_fn, attention_fn
            CompiledStep.__call__ = compiled_fn
    return results


def _agreement(model, reference, prompts: list[list[int]], tokens: int) -> dict:
    """How `model`'s greedy continuations agree with `reference`'s (both `LLM`s)."""
    from pagedserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in model.generate(prompts, params)]
    theirs = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(n)
    # Teacher-forced: the model's top-1 along the reference's continuations.
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    seqs = [p + t for p, t in zip(prompts, theirs, strict=True)]
    same = total = 0
    for prompt, seq, out in zip(prompts, seqs, model.generate(seqs, forced), strict=True):
        for i in range(len(prompt), len(seq)):
            same += greedy_top(out.prompt_logprobs[i]) == seq[i]
            total += 1
    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "identical_continuations": sum(n == tokens for n in prefixes),
        "mean_common_prefix": statistics.mean(prefixes),
        "teacher_forced_top1_agreement": same / total,
    }


def agreement_part(args: argparse.Namespace) -> list[dict]:
    """Kept quantized against dequantized, both in --dtype; and, for scale, dequantized bf16
    against dequantized float32 (what bf16 arithmetic alone changes). The kept model multiplies
    every step by the block dot products, whatever its rows (`BLOCK_DOT_MAX_ROWS` and the AMX
    crossovers raised): the teacher-forced passes are long steps, which would otherwise take
    the AMX tiles or the dequantized weights, and a row's block dot products do not depend on the
    other rows of its step, so each position scores as a decode step of one stream would."""
    from pagedserve.engine import LLM

    for dtype in quantized_linear.BLOCK_DOT_MAX_ROWS:
        quantized_linear.BLOCK_DOT_MAX_ROWS[dtype] = 1 << 20
    # nor AMX's bf16 tiles: the int8 rounding throughout
    quantized_linear.AMX_MIN_ROWS = quantized_linear.INTERLEAVED_AMX_MIN_ROWS = 1 << 20

    def load(quantization: str, dtype: str) -> LLM:
        return LLM(args.model, quantization=quantization, dtype=dtype, max_model_len=512)

    dense = load("none", args.dtype)
    prompts = [dense.get_tokenizer().encode(p) for p in PROMPTS]
    results = []
    comparisons = [(f"gguf_vs_none_{args.dtype}", load("gguf", args.dtype), dense)]
    if args.dtype == "bfloat16":
        comparisons.append(("none_bf16_vs_none_fp32", dense, load("none", "float32")))
    for name, model, reference in comparisons:
        record = {"comparison": name, **_agreement(model, reference, prompts, args.tokens)}
        print(json.dumps(record), flush=True)
        results.append(record)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--part", choices=("matmul", "step", "agreement", "all"), default="all")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    # As `pagedserve serve` and `bench` do: without it every large step buffer is a fresh mmap
    # and its page faults land in the timings.
    keep_large_allocations_in_heap()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("matmul", "all"):
        matmul_part(args)
    if args.part in ("step", "all"):
        step_part(args)
    if args.part in ("agreement", "all"):
        agreement_part(args)


if __name__ == "__main__":
    main()
