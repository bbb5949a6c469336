"""nano: nano-vllm's workload (`pagedserve bench throughput`) against its published numbers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu_engine import harness

# Output tok/s of nano-vllm's bench.py workload (256 requests, 100-1024 tokens in and out, seed 0:
# 133,966 output tokens) on one A800-SXM4-80GB, real weights, from
# https://github.com/cosmoliu2002/nano-vllm-triton/issues/1 (vLLM 0.10.2). The figure is
# output tokens / time (the sum of every request's max_tokens over the wall time).
NANO_VLLM_OUTPUT_TOKENS = 133_966
NANO_REFERENCE_SOURCE = "https://github.com/cosmoliu2002/nano-vllm-triton/issues/1 (A800)"
NANO_REFERENCE = {
    "qwen2.5-0.5b": {"vllm_0.10.2": 17711.01, "nano_vllm_triton": 24121.31},
    "llama-3.2-1b": {"vllm_0.10.2": 12627.36, "nano_vllm_triton": 15068.15},
}


def step_nano(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from pagedserve.bench.throughput import random_length_workload
    from pagedserve.engine.models.model_source import resolve_model
    from pagedserve.server import cli

    model = harness.model_path(harness.TINY if args.smoke else args.model, args.scratch)
    out = args.scratch / "nano.json"
    argv = [
        "bench", "throughput",
        "--model", model,
        "--load-format", "dummy",
        "--device", sizes.device,
        "--dtype", sizes.dtype,
        "--num-prompts", str(sizes.nano_prompts),
        "--input-len-range", *map(str, sizes.nano_input_range),
        "--output-len-range", *map(str, sizes.nano_output_range),
        "--dataset-seed", "0",
        "--temperature", "0.6",
        "--no-request-seeds",
        "--max-model-len", "4096",
        "--max-num-batched-tokens", str(sizes.nano_max_batched_tokens),
    ]  # fmt: skip
    if sizes.kv_cache_gib is not None:
        argv += ["--kv-cache-memory", str(sizes.kv_cache_gib)]
    base = {"model": args.model, "model_run": Path(model).name}
    with rec.part(**base):
        rc = cli.main([*argv, "--json", str(out)])
        if rc != 0:
            raise RuntimeError(f"pagedserve bench throughput exited with {rc}")
        result = json.loads(out.read_text())
        vocab = resolve_model(model).config.vocab_size
        _, output_lens = random_length_workload(
            sizes.nano_prompts, sizes.nano_input_range, sizes.nano_output_range, vocab, 0
        )
        record = {
            **result,
            **base,
            "command": "pagedserve " + " ".join(argv),
            "exact_output_tokens": result["num_output_tokens"] == sum(output_lens),
        }
        reference = NANO_REFERENCE.get(args.model)
        if reference is not None and not args.smoke:
            record["nano_vllm_workload"] = sum(output_lens) == NANO_VLLM_OUTPUT_TOKENS
            record["reference_output_tok_s_a800"] = reference
            record["reference_source"] = NANO_REFERENCE_SOURCE
            record["ratio_vs_vllm_a800"] = round(
                result["output_tokens_per_s"] / reference["vllm_0.10.2"], 3
            )
        rec.write(record)
