"""correctness: greedy tokens against transformers' (fp32 exact, bf16 counted), CUDA graphs
against eager; compare_tokens, which the other steps' checks use too."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_engine import harness
from pagedserve.scheduler.utils import cdiv


def transformers_greedy(
    config, prompts: list[list[int]], num_tokens: int, dtype: str, device: str
) -> tuple[list[list[int]], list[Any]]:
    """transformers' greedy tokens (`generate`, do_sample=False, no EOS) one prompt at a time,
    and the logits behind each step's choice ([num_tokens, vocab] per prompt, on the CPU)."""
    import torch

    from benchmarks.compare_transformers import hf_model_from_weights
    from pagedserve.engine.models.weights import dummy_weights

    torch_dtype = getattr(torch, dtype)
    hf = hf_model_from_weights(config, dummy_weights(config, torch_dtype), torch_dtype, device)
    tokens, scores = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            new = out.sequences[0, len(prompt) :].tolist()
            if len(new) != num_tokens:
                raise RuntimeError(f"transformers stopped after {len(new)} of {num_tokens} tokens")
            tokens.append(new)
            scores.append(torch.stack([s[0] for s in out.scores]).float().cpu())
    del hf
    harness.free_memory()
    return tokens, scores


def engine_greedy(
    model: str,
    prompts: list[list[int]],
    num_tokens: int,
    dtype: str,
    device: str,
    enforce_eager: bool,
) -> tuple[list[list[int]], dict[str, Any]]:
    """pagedserve's greedy tokens for all prompts generated together, and the engine's setup."""
    from pagedserve.engine import SamplingParams

    max_model_len = max(256, cdiv(max(map(len, prompts)) + num_tokens, 256) * 256)
    seq_lens = [len(p) + num_tokens for p in prompts]
    llm = harness.dummy_engine(
        model, device, dtype, seq_lens, max_model_len, enforce_eager=enforce_eager,
        max_num_seqs=len(prompts),
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    info = harness.engine_info(llm)
    del llm
    harness.free_memory()
    return [list(o.outputs[0].token_ids) for o in outputs], info


def compare_tokens(
    expected: list[list[int]], got: list[list[int]], scores: list[Any] | None = None
) -> dict[str, Any]:
    """Per prompt: tokens equal up to the first difference (prefix_match) and position by
    position; at the first difference, the reference's logit margin of its token over ours
    (a near-tie, ~1e-5 in fp32, is rounding; a large margin is a bug)."""
    prefix, positionwise, mismatches = [], [], []
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        pairs = list(zip(e, g, strict=False))  # lengths may differ: compare the common part
        first = next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))
        prefix.append(first)
        positionwise.append(sum(a == b for a, b in pairs))
        if first < len(e):
            entry: dict[str, Any] = {
                "prompt": i,
                "first_difference": first,
                "reference_token": e[first],
                "engine_token": g[first] if first < len(g) else None,
            }
            if scores is not None and first < len(g):
                row = scores[i][first]
                entry["reference_logit_margin"] = round(float(row[e[first]] - row[g[first]]), 6)
            mismatches.append(entry)
    n = len(expected)
    return {
        "equal": expected == got,
        "num_prompts": n,
        "num_equal_prompts": sum(e == g for e, g in zip(expected, got, strict=True)),
        "prefix_match": prefix,
        "mean_prefix_match": round(sum(prefix) / n, 3),
        "positionwise_match": positionwise,
        "mean_positionwise_match": round(sum(positionwise) / n, 3),
        "mismatches": mismatches,
    }


def write_graphs_and_eager_checks(
    rec: harness.Recorder, check: str, device: str, tokens: Callable[[str, bool], list[list[int]]]
) -> None:
    """The tiny model's `check` on `device`, with CUDA graphs and then eager: a record each of its
    tokens against the CPU engine's (eager). `tokens(device, eager)` runs an engine."""
    expected = tokens("cpu", True)
    for eager in (False, True):
        result = compare_tokens(expected, tokens(device, eager))
        rec.write({"model": "tiny", "check": check, "cuda_graphs": not eager, **result})


def step_correctness(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from pagedserve.engine.models.model_source import resolve_model

    n = sizes.correctness_tokens
    with harness.reuse_dummy_weights() as weight_stats:
        for name in sizes.correctness_models:
            model = harness.model_path(name, args.scratch)
            config = resolve_model(model).config
            rng = random.Random(1234)
            low = 1000 if config.vocab_size > 2000 else 3
            prompts = [
                [rng.randrange(low, config.vocab_size) for _ in range(length)]
                for length in sizes.correctness_prompt_lens
            ]
            base = {"model": name, "num_tokens": n, "prompt_lens": [len(p) for p in prompts]}
            for dtype in ("float32", "bfloat16"):
                ref: tuple[list[list[int]], list[Any]] | None = None
                with rec.part(**base, check=f"{dtype}_transformers"):
                    ref = transformers_greedy(config, prompts, n, dtype, sizes.device)
                runs: dict[bool, list[list[int]]] = {}
                for eager in (False, True):
                    mode = "eager" if eager else "default"
                    with rec.part(**base, check=f"{dtype}_vs_transformers", engine=mode):
                        tokens, info = engine_greedy(
                            model, prompts, n, dtype, sizes.device, enforce_eager=eager
                        )
                        runs[eager] = tokens
                        if ref is not None:
                            rec.write(
                                {
                                    **base,
                                    "check": f"{dtype}_vs_transformers",
                                    "dtype": dtype,
                                    "engine": mode,
                                    **info,
                                    "reference": "transformers generate, greedy, one prompt at "
                                    "a time; ours: all prompts in one batch",
                                    **compare_tokens(ref[0], tokens, ref[1]),
                                }
                            )
                if len(runs) == 2:
                    rec.write(
                        {
                            **base,
                            "check": f"{dtype}_eager_vs_default",
                            "dtype": dtype,
                            **compare_tokens(runs[True], runs[False]),
                        }
                    )
    rec.write({"check": "dummy_weights", **weight_stats})
