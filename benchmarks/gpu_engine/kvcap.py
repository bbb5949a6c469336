"""kvcap (optional): KV capacity, swap preemption and the fp8 cache in the engine."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import compare_tokens
from pagedserve.scheduler.utils import cdiv


def step_kvcap(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """KV capacity on the device: the tiny Llama's fp32 greedy tokens with swap
    preemption (4-token blocks, a pool too small for all at once, pinned host pool) equal the
    CPU engine's with a roomy pool, graphs and eager; with an fp8 cache calibrated on the first
    step (scales set in place after the graphs were captured), the share of positions that
    agree with the fp32 cache on the device; then the 1B shape, offline throughput with the fp8
    cache against bf16's in the same run."""
    from pagedserve.engine import LLM, SamplingParams

    tiny, prompts = harness.tiny_llama_prompts(args.scratch, sizes)
    params = SamplingParams(temperature=0, max_tokens=sizes.correctness_tokens, ignore_eos=True)
    lengths = [len(p) + sizes.correctness_tokens for p in prompts]
    max_model_len = cdiv(max(lengths), 16) * 16  # the longest fits; the pool is sized by it
    roomy = harness.kv_blocks_for(lengths, max_model_len)
    # 4-token blocks (many block boundaries to cross), a quarter of what all hold at once or
    # the longest alone: preemptions either way.
    block = 4
    tight = max(sum(cdiv(n, block) for n in lengths) // 4, cdiv(max_model_len, block))

    def run(device: str, eager: bool, **kwargs) -> tuple[list[list[int]], dict[str, Any]]:
        llm = LLM(
            tiny, device=device, dtype="float32", load_format="dummy", enforce_eager=eager,
            max_num_seqs=len(prompts), max_model_len=max_model_len, **kwargs,
        )  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        s = llm.engine.core.scheduler
        info = {
            **harness.engine_info(llm),
            "num_kv_blocks": llm.engine.core.worker.kv_plan.num_blocks,
            "preemptions": s.num_preemptions,
            "swap_outs": s.num_swap_outs,
            "swap_ins": s.num_swap_ins,
            "swapped_blocks_left": s.kv_cache_manager.num_swapped_blocks,
        }
        del llm
        harness.free_memory()
        return tokens, info

    with rec.part(model="tiny", check="fp32_swap_greedy"):
        expected, _ = run("cpu", True, num_kv_blocks=roomy)
        for eager in (False, True):
            got, info = run(
                sizes.device, eager, block_size=block, num_kv_blocks=tight,
                preemption_mode="swap", swap_space=1 << 30,
            )  # fmt: skip
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_swap_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got),
                    **info,
                }
            )
    with rec.part(model="tiny", check="fp8_greedy_agreement"):
        exact, _ = run(sizes.device, False, num_kv_blocks=roomy)
        got, info = run(
            sizes.device, False, num_kv_blocks=roomy, kv_cache_dtype="fp8",
            calculate_kv_scales=True,
        )  # fmt: skip
        pairs = [(a, b) for g, e in zip(got, exact, strict=True) for a, b in zip(g, e, strict=True)]
        same = sum(a == b for a, b in pairs)
        rec.write(
            {
                "model": "tiny",
                "check": "fp8_greedy_agreement",
                "engine": "default",
                "agreement": round(same / len(pairs), 3),
                **info,
            }
        )

    model = harness.model_path(args.model, args.scratch)

    def build(kv: str):
        return LLM(
            model, device=sizes.device, dtype=sizes.dtype, load_format="dummy",
            kv_cache_dtype=kv, **harness.offline_engine_sizes(sizes),
        )  # fmt: skip

    harness.a_against_b(
        rec, args.model, sizes, "kv_cache_dtype", {"auto": "bf16_tok_s", "fp8": "fp8_tok_s"}, build
    )
