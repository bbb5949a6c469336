"""tp (optional): tensor parallelism through its distributed path."""

from __future__ import annotations

import argparse

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import compare_tokens
from pagedserve.scheduler.utils import cdiv


def step_tp(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """Tensor parallelism on the device. With one GPU: the tiny Llama's fp32 greedy
    tokens through the distributed path at one rank (its all-reduces, the logits' gather and the
    ids' broadcast over an NCCL group of one, captured in the CUDA graphs) equal the plain
    engine's, graphs and eager; then the 1B shape's offline throughput both ways in the same run
    (target: the distributed path < 3% slower). Two ranks when there are two devices (on CPU,
    the --smoke run, always): the tiny Llama's greedy tokens equal one rank's."""
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.engine_config import EngineConfig
    from pagedserve.engine.tp_endpoint import TPEndpoint, free_port

    def build(distributed: bool, model: str, **kwargs) -> LLM:
        config = EngineConfig(model=model, device=sizes.device, load_format="dummy", **kwargs)
        endpoint = TPEndpoint(0, 1, "127.0.0.1", free_port(), 0) if distributed else None
        return LLM.from_config(config, endpoint)

    tiny, prompts = harness.tiny_llama_prompts(args.scratch, sizes)
    params = SamplingParams(temperature=0, max_tokens=sizes.correctness_tokens, ignore_eos=True)
    lengths = [len(p) + sizes.correctness_tokens for p in prompts]
    max_model_len = cdiv(max(lengths), 16) * 16
    tiny_args = dict(
        dtype="float32", max_num_seqs=len(prompts), max_model_len=max_model_len,
        num_kv_blocks=harness.kv_blocks_for(lengths, max_model_len),
    )  # fmt: skip

    def tokens_of(llm: LLM) -> list[list[int]]:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        llm.engine.close()
        return tokens

    with rec.part(model="tiny", check="fp32_tp1_greedy"):
        expected = tokens_of(build(False, tiny, **tiny_args))
        harness.free_memory()
        for eager in (False, True):
            got = tokens_of(build(True, tiny, enforce_eager=eager, **tiny_args))
            harness.free_memory()
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_tp1_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got),
                }
            )
    with rec.part(model="tiny", check="fp32_tp2_greedy"):
        import torch

        record = {"model": "tiny", "check": "fp32_tp2_greedy", "engine": "default"}
        if sizes.device == "cuda" and torch.cuda.device_count() < 2:
            rec.write({**record, "skipped": "one device: two ranks need two"})
        else:
            got = tokens_of(build(False, tiny, tensor_parallel_size=2, **tiny_args))
            harness.free_memory()
            rec.write({**record, **compare_tokens(expected, got)})

    model = harness.model_path(args.model, args.scratch)

    def build_path(path: str):
        return build(
            path == "distributed", model, dtype=sizes.dtype, **harness.offline_engine_sizes(sizes)
        )

    harness.a_against_b(
        rec, args.model, sizes, "path", {"plain": "plain_tok_s", "distributed": "tp1_tok_s"},
        build_path,
    )  # fmt: skip
