"""KV capacity: swap preemption (a preempted request's blocks go to a host pool and come back)
against recompute and an unconstrained run, on the tiny random Llama."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

PROMPT_LENGTHS = [1, 3, 7, 12, 17, 25, 31, 40]
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def _llm(path, **kwargs) -> LLM:
    """float32 on CPU, 4-token blocks: the eight prompts and their outputs need about 100 blocks
    at once (the longest alone 18)."""
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=96, **kwargs)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[list[int]]:
    roomy = _llm(tiny_llama_dir, num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in roomy.generate(_prompts(), PARAMS)]


def _swap_llm(path, num_host_blocks: int, **kwargs) -> LLM:
    """Swap mode with a device pool of 24 blocks (4x too small) and a host pool of
    `num_host_blocks` blocks."""
    probe = _llm(path, num_kv_blocks=24)
    swap_space = num_host_blocks * probe.engine.kv_plan.bytes_per_block
    return _llm(path, num_kv_blocks=24, preemption_mode="swap", swap_space=swap_space, **kwargs)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swap_and_recompute_give_the_unconstrained_tokens(tiny_llama_dir, expected, prefix_caching):
    recompute = _llm(tiny_llama_dir, num_kv_blocks=24, enable_prefix_caching=prefix_caching)
    got = [o.outputs[0].token_ids for o in recompute.generate(_prompts(), PARAMS)]
    assert got == expected
    scheduler = recompute.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swap_outs, scheduler.num_swap_ins) == (0, 0)

    swap = _swap_llm(tiny_llama_dir, 256, enable_prefix_caching=prefix_caching)
    got = [o.outputs[0].token_ids for o in swap.generate(_prompts(), PARAMS)]
    assert got == expected
    scheduler = swap.engine.scheduler
    kv = scheduler.kv_cache_manager
    # A host pool of 256 blocks takes every victim: each preemption swapped out, each swapped
    # request came back the same way, block for block.
    assert scheduler.num_swap_outs == scheduler.num_preemptions > 0
    assert scheduler.num_swap_ins == scheduler.num_swap_outs
    assert kv.num_swapped_out_blocks == kv.num_swapped_in_blocks > 0
    assert kv.num_swapped_blocks == 0
    assert kv.num_used_blocks == 0


def test_a_full_host_pool_falls_back_to_recompute(tiny_llama_dir, expected):
    """A host pool of 8 blocks holds one victim at a time: the others are recomputed."""
    swap = _swap_llm(tiny_llama_dir, 8)
    got = [o.outputs[0].token_ids for o in swap.generate(_prompts(), PARAMS)]
    assert got == expected
    scheduler = swap.engine.scheduler
    assert 0 < scheduler.num_swap_outs < scheduler.num_preemptions
    assert scheduler.num_swap_ins == scheduler.num_swap_outs
    assert scheduler.kv_cache_manager.num_swapped_blocks == 0
