"""Beam search on shared blocks (engine/core/beam_search.py) against transformers' own beam search
on the same tiny random Llama: the same sequences and scores, with and without EOS, and no block
left behind (finished, aborted, or with the engine's step in flight)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]
WIDTH, MAX_TOKENS = 4, 10
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=128)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _hf_beams(model, length_penalty: float, eos: int | None, **kwargs):
    out = model.generate(
        torch.tensor([PROMPT]), num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
        max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, eos_token_id=eos,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    sequences = [s[len(PROMPT) :].tolist() for s in out.sequences]
    # Sequences that ended in EOS are padded after it.
    sequences = [s[: s.index(eos) + 1] if eos in s else s for s in sequences]
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, -0.5])
def test_equals_transformers_when_no_beam_meets_eos(tiny_llama_dir, hf_model, length_penalty):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    params = BeamSearchParams(WIDTH, MAX_TOKENS, ignore_eos=True, length_penalty=length_penalty)
    (out,) = llm.beam_search([PROMPT], params)
    sequences, scores = _hf_beams(hf_model, length_penalty, eos=None)
    assert [s.token_ids for s in out.sequences] == sequences
    assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    for s in out.sequences:
        assert s.finish_reason == "length" and len(s.token_ids) == MAX_TOKENS
        assert s.score == pytest.approx(s.cumulative_logprob / MAX_TOKENS**length_penalty)
    kv = llm.engine.core.scheduler.kv_cache_manager
    assert kv.num_used_blocks == 0
    assert kv.num_block_copies > 0  # beams continued a shared partial block


def test_equals_transformers_never_stopping_early_when_beams_meet_eos(
    tiny_llama_dir, hf_model, tmp_path
):
    """With EOS, finished hypotheses (ended in EOS) compete with running beams by score. The
    engine stops only when no running beam can beat the worst of the k finished: that is
    transformers with early_stopping="never" (its default, a heuristic, may stop sooner)."""
    # EOS = the third token of the greedy beams: several beams meet it within max_tokens.
    model_dir = tmp_path / "tiny-llama-eos"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    free_sequences, _ = _hf_beams(hf_model, 1.0, eos=None)
    eos = free_sequences[0][2]
    config["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), **ENGINE)
    for length_penalty in (1.0, -0.5):
        params = BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty=length_penalty)
        (out,) = llm.beam_search([PROMPT], params)
        sequences, scores = _hf_beams(hf_model, length_penalty, eos, early_stopping="never")
        assert [s.token_ids for s in out.sequences] == sequences
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        ended = [s for s in out.sequences if s.finish_reason == "stop"]
        assert ended and all(s.token_ids[-1] == eos for s in ended)
        for s in out.sequences:
            length = len(s.token_ids)
            assert s.score == pytest.approx(s.cumulative_logprob / length**length_penalty)
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def _beams(engine: LLMEngine):
    return [r for r in engine.core.scheduler.running if r.request_id.startswith("beam-")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beams_share_blocks_each_round_and_free_them(tiny_llama_dir, async_scheduling):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), async_scheduling=async_scheduling, **ENGINE)
    )
    kv = engine.core.scheduler.kv_cache_manager
    params = BeamSearchParams(WIDTH, 30, ignore_eos=True).sampling_params()
    engine.add_request("search", PROMPT, params)
    seen_shared = False
    while len(_beams(engine)) < WIDTH or not seen_shared:
        assert engine.step() == []  # nothing comes out before the search ends
        beams = _beams(engine)
        if len(beams) == WIDTH and all(not b.send_in_full for b in beams):
            # 7 prompt tokens: the first block holds positions 0..3 of every beam.
            first_blocks = {kv.get_block_ids(b.request_id)[0] for b in beams}
            assert len(first_blocks) == 1 and kv.ref_counts(beams[0].request_id)[0] == WIDTH
            seen_shared = True
    # An abort mid-search frees every beam's blocks.
    aborted = engine.abort("search")
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * WIDTH
    while engine.has_unfinished_requests() or engine.core.scheduler.has_unfinished_requests():
        engine.step()
    assert kv.num_used_blocks == 0 and _beams(engine) == []

    # A whole search: the same results with asynchronous scheduling as without.
    engine.add_request("whole", PROMPT, params.clone(max_tokens=MAX_TOKENS))
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out
    sync = LLM(str(tiny_llama_dir), **ENGINE)
    (want,) = sync.beam_search([PROMPT], BeamSearchParams(WIDTH, MAX_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in done.outputs] == [s.token_ids for s in want.sequences]
    assert kv.num_used_blocks == 0


def test_beam_search_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="logprobs is not supported with use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, logprobs=1)
    with pytest.raises(ValueError, match="stop is not supported with use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, stop=["."])
    with pytest.raises(ValueError, match="best_of is not supported with use_beam_search"):
        SamplingParams(n=2, best_of=3, use_beam_search=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_searches_in_a_pool_too_small_for_them_give_the_same_beams(tiny_llama_dir, mode):
    """Eight searches of width 2 in 24 blocks: beams are preempted and come back in different
    steps, so a search's beams report their tokens apart. A beam whose token is in waits for its
    search's choice (`Request.awaiting_choice`) and computes nothing meanwhile: once it ran on
    alone and its search ended early, with beams of 2 to 5 tokens instead of 12. Idle beams are
    preempted to make room for the beams their searches wait for."""
    import random

    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 3, 7, 12, 17, 25, 31, 40)]
    params = SamplingParams(
        temperature=0, use_beam_search=True, n=2, max_tokens=12, ignore_eos=True
    )
    roomy = LLM(str(tiny_llama_dir), **{**ENGINE, "max_model_len": 96})
    want = [[c.token_ids for c in out.outputs] for out in roomy.generate(prompts, params)]
    swap = dict(preemption_mode="swap", swap_space=1 << 22) if mode == "swap" else {}
    tight = LLM(str(tiny_llama_dir), **{**ENGINE, "max_model_len": 96, "num_kv_blocks": 24}, **swap)
    got = [[c.token_ids for c in out.outputs] for out in tight.generate(prompts, params)]
    assert got == want
    assert all(len(tokens) == 12 for beams in got for tokens in beams)
    scheduler = tight.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swap_outs > 0) == (mode == "swap")
    assert scheduler.kv_cache_manager.num_used_blocks == 0
