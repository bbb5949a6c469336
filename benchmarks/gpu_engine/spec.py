"""spec: speculative decoding by prompt lookup against plain decoding (speed, acceptance, equal
greedy tokens), and n > 1 samples on shared blocks against as many seeded requests."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import compare_tokens
from pagedserve.scheduler.utils import cdiv

SPEC_NGRAM = 4  # speculative_ngram of the speculative engine: up to 4 drafts per step


def repeated_pattern_prompts(
    num: int, pattern_len: int, length: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Prompts that repeat a random pattern of pattern_len ids up to length ids, one pattern
    each: prompt lookup has n-grams to draft from at once."""
    patterns = harness.random_ids(num, pattern_len, vocab_size, seed)
    return [(p * cdiv(length, pattern_len))[:length] for p in patterns]


def _generate_ids(
    llm, prompts: list[list[int]], params, batch_size: int
) -> tuple[list[list[int]], float]:
    """Every prompt's token ids, batch_size prompts per generate call, and the wall time."""
    device = str(llm.engine.core.worker.device)
    tokens: list[list[int]] = []
    harness.sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs = llm.generate(prompts[i : i + batch_size], params)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    harness.sync(device)
    return tokens, time.perf_counter() - start


def step_spec(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """Plain and speculative engines on the same greedy requests at each batch size, then one
    n = 4 request against 4 seeded requests of its samples on the plain engine."""
    from pagedserve.engine import EngineConfig, SamplingParams
    from pagedserve.engine.models.model_source import resolve_model

    model = harness.model_path(args.model, args.scratch)
    vocab = resolve_model(model).config.vocab_size
    block_size = EngineConfig().cache.block_size
    # The samples share the prompt's KV but the last prompt token's: prompt_len - 1 tokens, 2
    # whole blocks and a partial one, which each sample must copy before its first write.
    shared_prompt_len = 2 * block_size + block_size // 2
    shared_samples, shared_max_tokens = 4, 16
    max_batch = max(sizes.spec_batch_sizes)
    spec_len = sizes.spec_prompt_len + sizes.spec_output_len
    max_model_len = cdiv(max(spec_len, shared_prompt_len + shared_max_tokens), 256) * 256
    seq_lens = [spec_len] * max_batch + [shared_prompt_len + shared_max_tokens] * shared_samples
    engines: dict[int, Any] = {}

    def engine_with(ngram: int):
        """One engine per speculative_ngram, built when first asked for. Both synchronous:
        drafts need it, and the plain engine must not get async scheduling's overlap that the
        speculative one cannot have, or the ratio would not be the drafts' alone."""
        if ngram not in engines:
            harness.free_memory()
            engines[ngram] = harness.dummy_engine(
                model, sizes.device, sizes.dtype, seq_lens, max_model_len,
                async_scheduling=False, speculative_ngram=ngram,
                max_num_seqs=max(max_batch, shared_samples),
            )  # fmt: skip
        return engines[ngram]

    prompts = repeated_pattern_prompts(
        sizes.spec_prompts, sizes.spec_pattern_len, sizes.spec_prompt_len, vocab, seed=7
    )
    warm = repeated_pattern_prompts(
        max_batch, sizes.spec_pattern_len, sizes.spec_prompt_len, vocab, seed=8
    )
    params = SamplingParams(temperature=0, max_tokens=sizes.spec_output_len, ignore_eos=True)
    base = {
        "model": args.model,
        "dtype": sizes.dtype,
        "num_prompts": sizes.spec_prompts,
        "pattern_len": sizes.spec_pattern_len,
        "prompt_len": sizes.spec_prompt_len,
        "output_len": sizes.spec_output_len,
        "speculative_ngram": SPEC_NGRAM,
    }
    with harness.reuse_dummy_weights() as weight_stats:
        for batch_size in sizes.spec_batch_sizes:
            with rec.part(**base, kind="speculative", batch_size=batch_size):
                runs: dict[int, dict[str, Any]] = {}
                for ngram in (0, SPEC_NGRAM):
                    llm = engine_with(ngram)
                    # Warm-up at this batch size: first-call costs and the Triton compiles of
                    # its shapes must not be timed.
                    llm.generate(warm[:batch_size], params.clone(max_tokens=8))
                    before = llm.engine.stats()
                    tokens, elapsed = _generate_ids(llm, prompts, params, batch_size)
                    after = llm.engine.stats()
                    runs[ngram] = {
                        "tokens": tokens,
                        "num_output_tokens": sum(map(len, tokens)),
                        "elapsed_s": elapsed,
                        "steps": after.num_steps - before.num_steps,
                        "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
                        "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens,
                        "used_blocks": after.kv_blocks_used,
                        "info": harness.engine_info(llm),
                    }
                plain, spec = runs[0], runs[SPEC_NGRAM]
                plain_rate = plain["num_output_tokens"] / plain["elapsed_s"]
                spec_rate = spec["num_output_tokens"] / spec["elapsed_s"]
                drafted, accepted = spec["drafted"], spec["accepted"]
                same = compare_tokens(plain["tokens"], spec["tokens"])
                rec.write(
                    {
                        **base,
                        "kind": "speculative",
                        "batch_size": batch_size,
                        "num_output_tokens": plain["num_output_tokens"],
                        "spec_num_output_tokens": spec["num_output_tokens"],
                        "plain_elapsed_s": round(plain["elapsed_s"], 4),
                        "spec_elapsed_s": round(spec["elapsed_s"], 4),
                        "plain_tok_s": round(plain_rate, 1),
                        "spec_tok_s": round(spec_rate, 1),
                        "speedup": round(spec_rate / plain_rate, 3),
                        "plain_steps": plain["steps"],
                        "spec_steps": spec["steps"],
                        "draft_tokens": drafted,
                        "accepted_tokens": accepted,
                        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                        # Greedy tokens are the same with and without drafts; bf16 rounding of
                        # a verify pass may tip a near-tie, which the first differences show.
                        "same_tokens": same["equal"],
                        "num_equal_prompts": same["num_equal_prompts"],
                        "mismatches": same["mismatches"][:4],
                        "used_blocks_after": [plain["used_blocks"], spec["used_blocks"]],
                        "plain_engine": plain["info"],
                        "spec_engine": spec["info"],
                    }
                )

        shared_base = {"model": args.model, "dtype": sizes.dtype, "kind": "shared_blocks"}
        with rec.part(**shared_base):
            llm = engine_with(0)
            kv = llm.engine.core.scheduler.kv_cache_manager
            (prompt,) = harness.random_ids(1, shared_prompt_len, vocab, seed=11)
            group_params = SamplingParams(
                n=shared_samples, temperature=1.0, seed=11, max_tokens=shared_max_tokens
            )
            copies_before = kv.num_block_copies
            (group,) = llm.generate([prompt], group_params)
            copies = kv.num_block_copies - copies_before
            shared = [list(c.token_ids) for c in sorted(group.outputs, key=lambda c: c.index)]
            # Sample k of a seeded request draws with seed + k: a request of its own with that
            # seed, which computes the prompt alone, must give the same tokens.
            alone_params = [group_params.clone(n=1, seed=11 + k) for k in range(shared_samples)]
            alone = llm.generate([prompt] * shared_samples, alone_params)
            separate = [list(o.outputs[0].token_ids) for o in alone]
            rec.write(
                {
                    **shared_base,
                    "prompt_len": shared_prompt_len,
                    "block_size": block_size,
                    "n": shared_samples,
                    "seed": 11,
                    "max_tokens": shared_max_tokens,
                    "same_tokens": shared == separate,
                    "samples_equal": [a == b for a, b in zip(shared, separate, strict=True)],
                    # Equal samples would hide a missed copy: they must differ.
                    "num_distinct_samples": len({tuple(t) for t in shared}),
                    "sample_lens": [len(t) for t in shared],
                    "num_block_copies": copies,
                    "num_used_blocks_end": kv.num_used_blocks,
                    **harness.engine_info(llm),
                }
            )
        engines.clear()
        harness.free_memory()
    rec.write({"kind": "dummy_weights", **weight_stats})
