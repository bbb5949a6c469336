"""What serving LoRA adapters costs: the same offline workload through one engine (LoRA on, 4
device slots), once with every request on the base model and once with the requests spread
round-robin over 4 random adapters (so every step mixes all of them), in alternating order, and
their ratio.

    python -m benchmarks.lora_throughput                     # SmolLM2, 64 x 128 in / 64 out
    python -m benchmarks.lora_throughput --smoke             # a tiny, fast run
    python -m benchmarks.lora_throughput --device cuda --dtype bfloat16

The adapters are PEFT folders written here (adapter_config.json + adapter_model.safetensors with
PEFT's tensor names), rank --rank on all seven target modules, random A and B scaled so the
deltas stay small: this measures cost, not quality.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.options import add_int_options
from pagedserve.bench.throughput import random_token_prompts
from pagedserve.engine import LLM, LoRARequest, SamplingParams
from pagedserve.engine.lora.adapter import projection_parts
from pagedserve.engine.models.model_config import ModelConfig

# PEFT's module names of the stacked projections' parts, in pagedserve's part order.
MODULES = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def write_random_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for `config` (every layer, all seven modules), seeded."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    parts = projection_parts(config)
    for layer in range(config.num_hidden_layers):
        for projection, names in MODULES.items():
            outs, in_features = parts[projection]
            for name, out in zip(names, outs, strict=True):
                prefix = f"base_model.model.model.layers.{layer}.{name}"
                a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
                b = torch.randn(out, rank, generator=gen) * 0.01
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    targets = [name.split(".")[-1] for names in MODULES.values() for name in names]
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                "target_modules": targets}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    add_int_options(parser, adapters=4, rank=16)
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the slots' padded rank")
    add_int_options(parser, num_prompts=64, input_len=128, output_len=64)
    parser.add_argument("--rounds", type=int, default=2, help="base/mixed pairs, alternating")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="8 prompts of 16 in / 8 out, 1 round")
    return parser


def _timed(llm: LLM, prompts, params, loras) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.rounds = 8, 16, 8, 1
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, enable_lora=True,
        max_loras=args.adapters, max_lora_rank=args.max_lora_rank,
    )  # fmt: skip
    core = llm.engine.core
    prompts = random_token_prompts(
        args.num_prompts, args.input_len, core.model_config.vocab_size, 0, set(core.eos_token_ids)
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_random_adapter(
                Path(tmp) / f"a{i}", core.model_config, args.rank, seed=i)))
            for i in range(args.adapters)
        ]  # fmt: skip
        mixed = [loras[i % len(loras)] for i in range(len(prompts))]
        llm.generate(prompts[:2], params, lora_request=mixed[:2])  # warm-up: slots filled once
        base_runs, mixed_runs = [], []
        for round_ in range(args.rounds):
            order = [(base_runs, None), (mixed_runs, mixed)]
            for runs, lora in order if round_ % 2 == 0 else order[::-1]:
                # Reversed prompts in odd rounds: no run finds its prompts in the prefix cache.
                batch = prompts if round_ % 2 == 0 else [p[::-1] for p in prompts]
                runs.append(_timed(llm, batch, params, lora))
    base, with_loras = max(base_runs), max(mixed_runs)
    result = {
        "model": args.model,
        "device": str(core.worker.device),
        "dtype": str(core.worker.dtype).removeprefix("torch."),
        "adapters": args.adapters,
        "rank": args.rank,
        "max_lora_rank": args.max_lora_rank,
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out, greedy",
        "base_output_tokens_per_s": round(base, 2),
        "mixed_output_tokens_per_s": round(with_loras, 2),
        "mixed_over_base": round(with_loras / base, 3),
        "slot_loads": core.worker.lora.num_slot_loads,
    }
    print(
        f"base {base:.1f} output tok/s, {args.adapters} adapters mixed {with_loras:.1f} "
        f"output tok/s: {with_loras / base:.3f}x (best of {args.rounds} each)"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
