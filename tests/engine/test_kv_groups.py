"""KV-cache groups in the engine: a Gemma-3-style model (five sliding layers with an 8-token
window, then a full one) generating far past its window holds only the blocks its groups need,
asserted from the block pool at every step, and still gives transformers' greedy tokens; prefix
caching over windowed groups gives the tokens of a cold run; the runner's per-group tables."""

from __future__ import annotations

import random

import numpy as np
import torch

from pagedserve.engine import LLM, LLMEngine, SamplingParams
from pagedserve.engine.worker.input_batch import InputBatch
from pagedserve.engine.worker.model_runner import to_model_inputs
from pagedserve.scheduler.kv_groups import blocks_per_request
from pagedserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tests.families import build_family
from tests.helpers import hf_greedy

BLOCK = 4
WINDOW = 8


def test_a_windowed_model_far_past_its_window_holds_only_its_groups_blocks(tmp_path):
    hf = build_family("gemma3", tmp_path)  # 6 layers: 5 sliding (window 8) and 1 full
    prompts = [[5, 9, 33, 70, 11], random.Random(3).sample(range(3, 256), 20)]
    new_tokens = 90
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=200,
        max_model_len=128, max_num_batched_tokens=16,
    )  # fmt: skip
    engine: LLMEngine = llm.engine
    plan = engine.core.worker.kv_plan
    assert plan.windows == (None,) + (WINDOW,) * 5  # six groups of one layer each
    kv = engine.core.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        most_held = max(most_held, kv.num_used_blocks)
    assert [outputs["0"], outputs["1"]] == expected
    # Each request ends at 95 or 110 tokens: 24 + 28 blocks in the full group; each sliding
    # group holds a window plus a chunk (at most 3 blocks once decoding, 7 while prefilling).
    bound = sum(blocks_per_request(plan.windows, len(p) + new_tokens, BLOCK, 16) for p in prompts)
    assert most_held <= bound == 52 + 2 * 5 * 7
    without_windows = 6 * (24 + 28)
    assert most_held < without_windows / 3
    assert kv.num_used_blocks == 0


def test_prefix_caching_over_windowed_groups_gives_the_cold_tokens(tmp_path):
    build_family("gemma3", tmp_path)
    rng = random.Random(11)
    prefix = [rng.randrange(3, 256) for _ in range(30)]  # far past the window
    prompts = [prefix + [5, 6], prefix + [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(caching: bool) -> tuple[list[list[int]], int]:
        llm = LLM(
            str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=200,
            max_model_len=64, enable_prefix_caching=caching,
        )  # fmt: skip
        tokens = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        return tokens, llm.engine.core.scheduler.kv_cache_manager.num_prefix_cache_hits_tokens

    cold, no_hits = run(False)
    warm, hits = run(True)
    assert warm == cold
    assert no_hits == 0
    # The second prompt finds the 30 shared tokens' 7 full blocks, and every sliding group still
    # holds (in the free list, hashes kept) the blocks its window needs at 28 tokens.
    assert hits == 28


def _prepare(batch: InputBatch, new: NewRequestData, tokens: int):
    """The step of `batch` that schedules `tokens` of the new request `new` alone."""
    out = SchedulerOutput(
        step_id=1, new_requests=(new,), cached_requests=CachedRequestData(),
        num_scheduled_tokens={new.request_id: tokens}, total_num_scheduled_tokens=tokens,
        preempted_request_ids=(), finished_request_ids=(),
    )  # fmt: skip
    batch.apply(out)
    return batch.prepare(out, batch.rows_of(out), BLOCK)


def test_the_runner_reads_each_groups_table_and_points_dropped_entries_at_a_live_block():
    batch = InputBatch(2, 64, 16, windows=(None, WINDOW))
    # 22 known tokens, 20 computed: logical blocks 0..5, interleaved (full, sliding); the
    # sliding group has given back its blocks 0..2 (ids shown as 0).
    table = [10, 0, 11, 0, 12, 0, 13, 23, 14, 24, 15, 25]
    step = _prepare(batch, NewRequestData("a", tuple(range(22)), 22, tuple(table), 20,
                                          SamplingParams()), 2)  # fmt: skip
    assert step.block_tables.shape == (2, 1, 6)
    assert step.block_tables[0].tolist() == [[10, 11, 12, 13, 14, 15]]
    # Positions 20, 21 see 13..21: sliding blocks 3..5; the ones before point at block 25.
    assert step.block_tables[1].tolist() == [[25, 25, 25, 23, 24, 25]]
    assert step.slot_mapping.tolist() == [[15 * 4, 15 * 4 + 1], [25 * 4, 25 * 4 + 1]]
    assert np.array_equal(step.positions, [20, 21])


def test_a_lone_one_block_request_gets_row_major_tables_of_each_group():
    """One request whose prompt fits one block, in a model with two groups: the step's tables
    [2, 1, 1] are a transposed view that numpy calls contiguous (its size-1 dims' strides do not
    count) and left uncopied; on the device they have row-major strides all the same, so that each
    group's table [1, 1] has dense rows, as the compiled attention kernel checks (it once refused
    them: a lone short request of Gemma 2 or 3 killed the engine)."""
    batch = InputBatch(2, 64, 16, windows=(None, WINDOW))
    step = _prepare(batch, NewRequestData("a", (5, 6, 7), 3, (10, 20), 0, SamplingParams()), 3)
    meta = to_model_inputs(step, torch.device("cpu")).meta
    assert meta.block_tables.tolist() == [[[10]], [[20]]]
    assert meta.block_tables.stride() == (1, 1, 1)
    assert [meta.block_tables[g].stride() for g in range(2)] == [(1, 1), (1, 1)]
    assert meta.slot_mapping.tolist() == [[40, 41, 42], [80, 81, 82]]
    assert meta.slot_mapping.stride() == (3, 1)


def test_a_rewind_past_the_window_computes_the_request_again_and_matches_transformers(tmp_path):
    """Rewound to where the sliding groups already gave their blocks back, the request is
    computed again from its start and goes on with transformers' tokens; a rewind within the
    window keeps its blocks."""
    hf = build_family("gemma3", tmp_path)
    prompt = [5, 9, 33, 70, 11, 8]
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=200,
        max_model_len=64,
    )  # fmt: skip
    engine: LLMEngine = llm.engine
    kv = engine.core.scheduler.kv_cache_manager
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    out = None
    while out is None or len(out.outputs[0].token_ids) < 24:
        outputs = engine.step()
        out = outputs[-1] if outputs else out
    first = list(out.outputs[0].token_ids)
    (within,) = engine.rewind("r", 2)  # 28 tokens left: the window at 27 is still held
    assert within.outputs[0].token_ids == first[:22]
    assert kv.num_held_blocks("0:r") > 0
    (past,) = engine.rewind("r", 18)  # 10 tokens left: the window at 9 was given back
    assert past.outputs[0].token_ids == first[:4]
    assert kv.num_held_blocks("0:r") == 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            out = output
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 30)
    assert kv.num_used_blocks == 0
