"""The engine's greedy tokens equal transformers' for tiny random Llama and Qwen2 checkpoints,
with many prompts of different lengths generated together through a small-block paged cache."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine import LLM, SamplingParams
from tests.helpers import hf_greedy

PROMPT_LENGTHS = [1, 3, 7, 12, 17, 25, 31, 40]


def _tiny_llm(path, **kwargs) -> LLM:
    """The engine on CPU in float32 with 4-token blocks, so prompts span many blocks."""
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_equals_transformers(kind, tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, 32) for p in prompts]

    llm = _tiny_llm(path, num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # Every block is back in the pool once all requests are done.
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(tiny_llama_dir):
    """A token budget smaller than the prompts forces prefill in chunks over several steps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    prompts = _prompts(hf.config.vocab_size)[-3:]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    llm = _tiny_llm(
        tiny_llama_dir,
        num_kv_blocks=128,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_preemption_gives_the_same_tokens(tiny_llama_dir):
    """A pool too small for all requests at once: requests get preempted, recomputed, and still
    produce exactly the unconstrained greedy tokens."""
    prompts = _prompts(512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    roomy = _tiny_llm(tiny_llama_dir, num_kv_blocks=256)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]

    # Longest request needs ceil((40 + 32) / 4) = 18 blocks; all eight together need ~100.
    tight = _tiny_llm(
        tiny_llama_dir,
        num_kv_blocks=24,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_prefix_cache_hit_gives_the_same_tokens(tiny_llama_dir):
    """A second request sharing a long prefix reuses cached blocks and still matches."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    a, b = prefix + [5, 6], prefix + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = _tiny_llm(
        tiny_llama_dir,
        num_kv_blocks=64,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    expected = [o.outputs[0].token_ids for o in cold.generate([a, b], params)]
    warm = _tiny_llm(
        tiny_llama_dir,
        num_kv_blocks=64,
        max_model_len=128,
    )
    first = warm.generate([a], params)[0].outputs[0].token_ids
    second = warm.generate([b], params)[0].outputs[0].token_ids
    assert [first, second] == expected
    # 20 shared tokens = 5 full blocks of 4 found in the cache for the second request.
    assert warm.engine.core.scheduler.kv_cache_manager.num_prefix_cache_hits_tokens == 20
