"""KV capacity and visibility on the tiny random Llama: swap preemption (a preempted request's
blocks go to a host pool and come back) against recompute and an unconstrained run, and the live
block map (GET /v1/kv's body)."""

from __future__ import annotations

import json
import random

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from scheduler.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED

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


def test_kv_map_shows_shared_forked_and_cached_blocks(tiny_llama_dir):
    """The live block map (GET /v1/kv's body) block by block, for a request of n = 2 and a
    second one sharing its first 8 tokens (two blocks of 4) through the prefix cache."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=4,
            num_kv_blocks=32, max_model_len=64,
        )
    )  # fmt: skip
    prefix = list(range(10, 18))
    engine.add_request(
        "a", prefix + [30, 31], SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True)
    )
    engine.add_request(
        "b", prefix + [40, 41, 42], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )

    def kv_map() -> dict:
        return json.loads(engine.kv_map())

    def tables(m: dict) -> dict:
        return {
            r["id"]: (r["status"], r["num_computed_tokens"], r["block_ids"]) for r in m["requests"]
        }

    engine.step()
    m = kv_map()
    # a's first sample computed its 10 prompt tokens into blocks 0-2; b found blocks 0 and 1 in
    # the prefix cache (8 tokens) and computed its other 3 into block 3; a's second sample
    # forked blocks 0-2 once a's first token came back (no copy), its last prompt token to go.
    assert tables(m) == {
        "0:a": ("running", 10, [0, 1, 2]),
        "1:a": ("running", 9, [0, 1, 2]),
        "0:b": ("running", 11, [0, 1, 3]),
    }
    assert m["blocks"]["state"][:5] == [BLOCK_USED] * 4 + [BLOCK_FREE]
    assert m["blocks"]["ref_count"][:5] == [3, 3, 2, 1, 0]
    assert m["blocks"]["cached"][:5] == [True, True, False, False, False]
    assert m["owners"] == {"0": ["0:a", "0:b", "1:a"], "1": ["0:a", "0:b", "1:a"],
                           "2": ["0:a", "1:a"], "3": ["0:b"]}  # fmt: skip
    totals = m["totals"]
    assert (totals["used_blocks"], totals["free_blocks"], totals["shared_blocks"]) == (4, 28, 3)
    assert (totals["prefix_cache_queries"], totals["prefix_cache_hits"]) == (10 + 11, 8)
    # Unused slots of the last blocks: 12 - 10, 12 - 9 and 12 - 11.
    assert totals["fragmentation_tokens"] == 2 + 3 + 1
    assert totals["fragmentation"] == 6 / (4 * 4)

    engine.step()
    m = kv_map()
    # a's first sample wrote into block 2, which its sibling shares: copy-on-write into block 4.
    assert tables(m)["0:a"] == ("running", 11, [0, 1, 4])
    assert tables(m)["1:a"] == ("running", 10, [0, 1, 2])
    assert m["blocks"]["ref_count"][:6] == [3, 3, 1, 1, 1, 0]
    assert m["totals"]["shared_blocks"] == 2

    while engine.has_unfinished_requests():
        engine.step()
    m = kv_map()
    assert m["requests"] == [] and m["owners"] == {}
    # Every block is back: the full ones still findable by their prefix (free but cached).
    states = m["blocks"]["state"]
    assert BLOCK_USED not in states
    assert [i for i, s in enumerate(states) if s == BLOCK_CACHED] == [
        i for i, cached in enumerate(m["blocks"]["cached"]) if cached
    ]
    assert m["totals"]["cached_free_blocks"] == m["totals"]["cached_blocks"] == 8
    assert m["totals"]["used_blocks"] == m["totals"]["fragmentation_tokens"] == 0
    assert m["kv_cache_dtype"] == "float32"
    assert m["bytes_per_block"] == engine.kv_plan.bytes_per_block
