"""Speculative decoding by prompt lookup (`speculative_ngram`): drafts from earlier n-grams of the
sequence, verified in one forward pass. Greedy outputs are exactly those without it; rejected
drafts leave no slot or block behind."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from pagedserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig
from pagedserve.scheduler.ngram import NgramIndex
from pagedserve.server.metrics.pagedserve_metrics import Metrics
from tests.helpers import finish_all


def _latest_match(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup by brute force: the longest suffix with an earlier occurrence, latest first."""
    end = len(tokens) - 1
    for n in range(min(n_max, end + 1), n_min - 1, -1):
        suffix = list(tokens[end - n + 1 :])
        for last in range(end - 1, n - 2, -1):
            if list(tokens[last - n + 1 : last + 1]) == suffix:
                return list(tokens[last + 1 : last + 1 + k])
    return []


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_the_index_proposes_what_a_scan_finds(tokens, n_min, extra, k):
    index = NgramIndex(n_min, n_min + extra)
    # Grown one token at a time, as a request's tokens are, and asked at every length.
    grown: list[int] = []
    for token in tokens:
        grown.append(token)
        assert index.propose(grown, k) == _latest_match(grown, n_min, n_min + extra, k)


# ---- the scheduler, with a model made of plain Python ---------------------------------------


def _cycling_model(tokens: Sequence[int]) -> int:
    """Repeats the token 5 back, except at every 13th position: drafts are often right, not
    always."""
    if len(tokens) % 13 == 0:
        return (tokens[-1] * 3 + 1) % 50
    return tokens[-5]


def _run_scheduler(spec_k: int, max_tokens: int) -> tuple[dict[str, list[int]], Scheduler]:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
            enable_prefix_caching=True,
            num_speculative_tokens=spec_k,
            ngram_min=2,
            ngram_max=3,
        )
    )
    rng = random.Random(5)
    for i in range(4):
        prompt = [rng.randrange(50) for _ in range(6 + i)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[7])
        scheduler.add_request(Request(f"r{i}", prompt, params))
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampling = scheduler._sampling.get(out.step_id, [])
        sampled, accepted = {}, {}
        for request in sampling:
            drafts = out.spec_token_ids.get(request.request_id, ())
            tokens = list(request.all_token_ids)
            picked = []
            for j in range(len(drafts) + 1):  # the model at each verified position
                picked.append(_cycling_model(tokens + list(drafts[:j])))
                if j == len(drafts) or picked[-1] != drafts[j]:
                    break
            sampled[request.request_id] = picked[0]
            if drafts:
                accepted[request.request_id] = picked
        for delta in scheduler.update_from_output(out, sampled, accepted):
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for request in scheduler.running:  # progress is back where the accepted tokens end
            assert request.num_computed_tokens == len(request.all_token_ids) - 1
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    return outputs, scheduler


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 40])
def test_the_scheduler_applies_accepted_drafts_under_the_stop_rules(max_tokens):
    plain, _ = _run_scheduler(0, max_tokens)
    speculative, scheduler = _run_scheduler(4, max_tokens)
    assert speculative == plain
    assert all(len(tokens) <= max_tokens for tokens in plain.values())
    if max_tokens == 40:
        assert any(7 in tokens for tokens in plain.values())  # a stop token ended one
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens


# ---- the engine on the tiny random Llama -----------------------------------------------------

REPETITIVE = [[10, 11, 12, 13, 14] * 4, [30, 31, 32] * 6 + [30], [50 + i % 7 for i in range(25)]]


def _engine(model_dir, **changes) -> LLMEngine:
    config = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4)
    config["max_model_len"] = 128
    return LLMEngine(EngineConfig(**{**config, "num_kv_blocks": 96, **changes}))


def _generate(engine: LLMEngine, prompts, params) -> list[list[int]]:
    return _generate_each(engine, prompts, [params] * len(prompts))


def _generate_each(engine: LLMEngine, prompts, params) -> list[list[int]]:
    requests = {str(i): pair for i, pair in enumerate(zip(prompts, params, strict=True))}
    done = {i: out.outputs[0].token_ids for i, out in finish_all(engine, requests).items()}
    return [done[str(i)] for i in range(len(prompts))]


def test_greedy_tokens_equal_those_without_drafts(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _engine(tiny_llama_dir)
    expected = _generate(plain, REPETITIVE, params)
    spec = _engine(tiny_llama_dir, speculative_ngram=5)
    assert _generate(spec, REPETITIVE, params) == expected
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert spec.core.num_steps < plain.core.num_steps
    # /metrics shows both counters.
    exposition = generate_latest(Metrics(spec.stats).registry).decode()
    assert f"pagedserve_spec_decode_draft_tokens_total {stats.spec_draft_tokens:.1f}" in exposition
    assert (
        f"pagedserve_spec_decode_accepted_tokens_total {stats.spec_accepted_tokens:.1f}"
        in exposition
    )
    # A stop token and max_tokens that fall inside a run of accepted drafts end it there.
    stop = expected[0][17]
    for changes in ({"stop_token_ids": [stop]}, {"max_tokens": 13}):
        params2 = params.clone(**changes)
        assert _generate(spec, REPETITIVE, params2) == _generate(plain, REPETITIVE, params2)


def test_seeded_sampled_tokens_equal_those_without_drafts(tiny_llama_dir):
    """Each verified position draws from the request's own distribution with the number its
    seed gives that output position, so a seeded request's tokens do not depend on drafts; a
    request with penalties in the same batch gets none and is unchanged too."""
    sampled = SamplingParams(temperature=0.25, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)
    penalized = sampled.clone(seed=4, repetition_penalty=1.3)
    prompts = REPETITIVE + REPETITIVE[:1]
    params = [sampled] * len(REPETITIVE) + [penalized]
    plain = _generate_each(_engine(tiny_llama_dir), prompts, params)
    spec = _engine(tiny_llama_dir, speculative_ngram=4)
    assert _generate_each(spec, prompts, params) == plain
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_requests_with_logprobs_or_penalties_get_no_drafts(tiny_llama_dir):
    spec = _engine(tiny_llama_dir, speculative_ngram=5)
    for params in (
        SamplingParams(temperature=0, logprobs=1, max_tokens=20),
        SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=20),
        SamplingParams(temperature=0.8, seed=1, frequency_penalty=0.5, max_tokens=20),
    ):
        _generate(spec, REPETITIVE, params)
    assert spec.stats().spec_draft_tokens == 0


def test_speculative_options_are_checked():
    with pytest.raises(ValueError, match="speculative_ngram must be >= 0"):
        EngineConfig(speculative_ngram=-1)
    with pytest.raises(ValueError, match="speculative_ngram_min <= speculative_ngram_max"):
        EngineConfig(speculative_ngram=3, speculative_ngram_min=4, speculative_ngram_max=2)
    with pytest.raises(ValueError, match="needs synchronous scheduling"):
        EngineConfig(speculative_ngram=3, async_scheduling=True)


# ---- the real model --------------------------------------------------------------------------


def test_real_model_greedy_outputs_equal_with_and_without_drafts(real_llm):
    """16 prompts, half of them asking to repeat text, through the chat template."""
    texts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
        "Copy this list: apples, pears, plums, apples, pears, plums.",
        "Write def add(a, b): return a + b three times.",
        "Count from 1 to 20 separated by commas.",
        "Say 'hello world' five times.",
        "Repeat: to be or not to be, that is the question.",
        "Spell the word banana letter by letter.",
        "List the days of the week twice.",
        "What is the capital of France?",
        "Name three primary colours.",
        "Why is the sky blue?",
        "Give me a haiku about the sea.",
        "What is 12 times 12?",
        "Describe a cat in one sentence.",
        "Translate 'good morning' into French.",
        "What does a CPU do?",
    ]
    conversations = [[{"role": "user", "content": text}] for text in texts]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [o.outputs[0].token_ids for o in real_llm.chat(conversations, params)]
    spec = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", quantization="none",
               num_kv_blocks=512, speculative_ngram=4)  # fmt: skip
    got = [o.outputs[0].token_ids for o in spec.chat(conversations, params)]
    assert got == expected
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert spec.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
