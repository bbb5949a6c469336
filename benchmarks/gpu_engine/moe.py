"""moe (optional): a tiny Qwen3-MoE's fp32 greedy tokens against transformers', then offline
throughput of a Qwen3-30B-A3B-shaped model."""

from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import (
    compare_tokens,
    engine_greedy,
    transformers_greedy,
)
from benchmarks.options import flags
from pagedserve.engine.models.hf_config import config_from_hf_dict

# A tiny Qwen3-MoE (8 experts, 2 per token) for the MoE correctness check and its smoke run.
TINY_QWEN3_MOE: dict[str, Any] = {
    **harness.TINY_LLAMA,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
}
# The throughput model: Qwen3-30B-A3B's layer (128 experts of 768, 8 per token, hidden 2048)
# with fewer layers, so that its dummy weights are drawn in seconds (the per-layer cost is the
# model's own; the whole model has 48 layers).
MOE_THROUGHPUT_LAYERS = 4


def step_moe(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """A tiny Qwen3-MoE's fp32 greedy tokens against transformers' (the fused MoE kernel
    compiled, graphs and eager), then offline throughput of a Qwen3-30B-A3B-shaped model."""
    from pagedserve.engine.models.builtin_shapes import BUILTIN_SHAPES
    from pagedserve.server import cli

    tiny = args.scratch / "tiny-qwen3-moe"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    config = config_from_hf_dict(TINY_QWEN3_MOE)
    prompts = [
        harness.random_ids(1, n, config.vocab_size, i)[0]
        for i, n in enumerate(sizes.correctness_prompt_lens)
    ]
    n = sizes.correctness_tokens
    with rec.part(model="tiny-qwen3-moe", check="fp32_greedy"):
        expected, scores = transformers_greedy(config, prompts, n, "float32", sizes.device)
        for eager in (False, True):
            got, info = engine_greedy(str(tiny), prompts, n, "float32", sizes.device, eager)
            rec.write(
                {
                    "model": "tiny-qwen3-moe",
                    "check": "fp32_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got, scores),
                    **info,
                    "num_tokens": n,
                }
            )

    shape = TINY_QWEN3_MOE if args.smoke else BUILTIN_SHAPES["qwen3-30b-a3b"]
    shape = {**shape, "num_hidden_layers": min(shape["num_hidden_layers"], MOE_THROUGHPUT_LAYERS)}
    folder = args.scratch / "qwen3-moe-shaped"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    moe_config = config_from_hf_dict(shape)
    out = args.scratch / "moe.json"
    argv = ["bench", "throughput"] + flags(
        model=folder, load_format="dummy", device=sizes.device, dtype=sizes.dtype,
        num_prompts=sizes.offline_prompts, input_len=sizes.offline_input_len,
        output_len=sizes.offline_output_len,
        max_model_len=sizes.offline_input_len + sizes.offline_output_len + 256,
        kv_cache_memory=sizes.kv_cache_gib,
    )  # fmt: skip
    base = {
        "model": "qwen3-30b-a3b-shaped",
        "num_hidden_layers": moe_config.num_hidden_layers,
        "num_params": moe_config.num_params(),
        "num_active_params": moe_config.num_active_params(),
    }
    with rec.part(**base, kind="throughput"):
        rc = cli.main([*argv, "--json", str(out)])
        if rc != 0:
            raise RuntimeError(f"pagedserve bench throughput exited with {rc}")
        rec.write(
            {
                **json.loads(out.read_text()),
                **base,
                "kind": "throughput",
                "command": "pagedserve " + " ".join(argv),
            }
        )
