"""lora (optional): issue 39's device paths. The Triton shrink/expand (kernels/triton_lora.py)
against the per-token reference for a batch mixing ranks 8, 16 and 64 and the base model; the
tiny Llama's greedy tokens with two adapters and the base model in one batch, on the device with
CUDA graphs and eagerly, against the CPU engine; and what 4 adapters mixed in every step cost
against the base model alone (benchmarks/lora_throughput.py's workload)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import write_graphs_and_eager_checks
from pagedserve.engine.models.hf_config import config_from_json_file

# The kernels against the float32 reference on the CPU: fp32 (TF32 off in the engine's fp32
# runs, summation order only) and bf16 (the deltas are rounded to bf16 twice, as PEFT's are).
MAX_ABS_DIFF = {"float32": 1e-4, "bfloat16": 0.1}


def _kernel_check(device: str, dtype_name: str) -> dict:
    import torch

    from pagedserve import kernels
    from pagedserve.kernels.lora import group_tokens, lora_add_reference

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    ranks, max_rank, parts, in_features = (8, 16, 64, 32), 64, (512, 128, 128), 384
    a = torch.randn(len(ranks), len(parts), max_rank, in_features, generator=gen) * 0.05
    b = torch.randn(len(ranks), sum(parts), max_rank, generator=gen) * 0.05
    for slot, rank in enumerate(ranks):
        a[slot, :, rank:], b[slot, :, rank:] = 0, 0
    slots = torch.tensor([(t % 5) - 1 for t in range(96)])  # -1 (the base model), 0, 1, 2, 3
    x = torch.randn(len(slots), in_features, generator=gen)
    y = torch.randn(len(slots), sum(parts), generator=gen)
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, parts)
    on = [t.to(device, dtype) for t in (y, x, a, b)]
    # On the CPU (the smoke run) the grouped torch path: the Triton kernels need the device.
    groups = group_tokens(slots.numpy(), ranks) if device == "cpu" else None
    kernels.lora_add(*on, parts, token_slots=slots.to(device), groups=groups)
    diff = float((on[0].float().cpu() - want).abs().max())
    base = slots < 0
    untouched = bool((on[0].float().cpu()[base] == y.to(dtype).float()[base]).all())
    return {
        "check": f"triton_lora_{dtype_name}",
        "tokens": len(slots),
        "max_abs_diff": diff,
        "base_rows_untouched": untouched,
        "ok": diff <= MAX_ABS_DIFF[dtype_name] and untouched,
    }


def step_lora(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from benchmarks.lora_throughput import write_random_adapter
    from pagedserve.engine import LLM, LoRARequest, SamplingParams

    with rec.part(model="kernels", check="triton_lora"):
        for dtype_name in ("float32", "bfloat16"):
            rec.write({"model": "kernels", **_kernel_check(sizes.device, dtype_name)})

    with rec.part(model="tiny", check="lora_greedy"):
        tiny, prompts = harness.tiny_llama_prompts(args.scratch, sizes)
        config = config_from_json_file(Path(tiny) / "config.json")
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_random_adapter(
                args.scratch / f"adapter{i}", config, rank=8 * (i + 1), seed=i)))
            for i in range(2)
        ]  # fmt: skip
        batch = [p for p in prompts for _ in range(3)]
        mixed = [lora for _ in prompts for lora in (None, *loras)]
        params = SamplingParams(temperature=0, max_tokens=sizes.correctness_tokens)

        def tokens(device: str, eager: bool) -> list[list[int]]:
            llm = LLM(
                tiny, device=device, dtype="float32", load_format="dummy", enforce_eager=eager,
                max_num_seqs=len(batch), enable_lora=True, max_loras=2, max_lora_rank=16,
            )  # fmt: skip
            outputs = llm.generate(batch, params, lora_request=mixed)
            del llm
            harness.free_memory()
            return [list(o.outputs[0].token_ids) for o in outputs]

        write_graphs_and_eager_checks(rec, "lora_greedy", sizes.device, tokens)

    with rec.part(model=args.model, part="throughput"):
        from benchmarks import lora_throughput

        model = "smollm2-135m-instruct" if args.smoke else args.model
        options = ["--model", model, "--device", sizes.device, "--dtype", sizes.dtype]
        if args.smoke:
            options.append("--smoke")
        else:
            options += ["--num-prompts", "256", "--input-len", "512", "--output-len", "128"]
        result = lora_throughput.run(lora_throughput.build_parser().parse_args(options))
        rec.write({"part": "throughput", **result})
