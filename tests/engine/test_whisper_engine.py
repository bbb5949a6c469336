"""Continuous batching of Whisper transcriptions (engine/core/whisper_engine.py) on the tiny random
checkpoint of tests/conftest.py: the tokens equal the reference's greedy decoding whatever the
batch, each request's cross-attention blocks are allocated once at admission and both KV groups
are freed when it ends or is aborted, and requests wait for blocks and for the step's encoder
budget."""

from __future__ import annotations

import collections

import pytest
import torch

from pagedserve.engine.core.whisper_engine import TranscriptionRequest, WhisperEngine
from pagedserve.engine.models.whisper import greedy
from pagedserve.scheduler.block_pool import BlockPool
from tests.helpers import whisper_features

PROMPTS = [[3], [3, 10], [3, 10, 11, 12, 13], [3, 7], [3, 8, 9]]
# 150 encoder positions in blocks of 16: 10 cross-attention blocks per request; then the
# self-attention blocks of the prompt + 12 new tokens: 1 block for prompts of up to 4 tokens, 2
# for the 5-token prompt.
BLOCKS = [11, 11, 12, 11, 11]


def _requests(n: int, max_tokens: int = 12, seed: int = 2) -> list[TranscriptionRequest]:
    features = whisper_features(n, seed=seed)
    return [TranscriptionRequest(f"r{i}", features[i], PROMPTS[i], max_tokens)
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("max_num_seqs", [5, 2])
def test_tokens_equal_the_reference_in_any_batch(tiny_whisper, max_num_seqs):
    _, _, model = tiny_whisper
    requests = _requests(5)
    expected = greedy(model, torch.stack([r.features for r in requests]), PROMPTS, 12)
    engine = WhisperEngine(model, num_blocks=64, max_num_seqs=max_num_seqs)
    for r in requests:
        engine.add(r)
    done = engine.run()
    assert sorted(r.request_id for r in done) == [f"r{i}" for i in range(5)]
    assert [r.output for r in requests] == expected
    assert all(r.finish_reason in ("stop", "length") for r in requests)
    assert engine.pool.num_free_blocks == 64 and engine.pool.usage == 0.0


def test_cross_blocks_are_allocated_once_at_admission_and_both_groups_freed(
    tiny_whisper, monkeypatch
):
    _, _, model = tiny_whisper
    engine = WhisperEngine(model, num_blocks=64)
    allocations = []
    real = BlockPool.allocate
    monkeypatch.setattr(
        BlockPool, "allocate", lambda self, n: allocations.append(n) or real(self, n)
    )
    requests = _requests(3)
    for r in requests:
        engine.add(r)
    engine.step()
    assert allocations == BLOCKS[:3]  # all three admitted in the first step, once each
    assert [len(r.cross_blocks) for r in requests] == [10, 10, 10]
    assert [len(r.self_blocks) for r in requests] == [1, 1, 2]
    held = {b.block_id for r in requests for b in r.cross_blocks + r.self_blocks}
    assert len(held) == 34 and engine.pool.num_free_blocks == 64 - 34
    while engine.has_unfinished:
        engine.step()
    assert allocations == BLOCKS[:3]  # nothing allocated while decoding
    assert engine.pool.num_free_blocks == 64
    assert all(not r.cross_blocks and not r.self_blocks for r in requests)


def test_abort_frees_both_groups_of_a_running_and_a_waiting_request(tiny_whisper):
    _, _, model = tiny_whisper
    engine = WhisperEngine(model, num_blocks=24)  # room for r0 and r1 (11 each), not r2 (12)
    requests = _requests(3)
    for r in requests:
        engine.add(r)
    engine.step()
    assert [r.request_id for r in engine.running] == ["r0", "r1"]
    assert [r.request_id for r in engine.waiting] == ["r2"]
    assert engine.pool.num_free_blocks == 2
    assert engine.abort("r1") and requests[1].finish_reason == "abort"
    assert engine.pool.num_free_blocks == 13
    assert engine.abort("r2") and not engine.waiting
    assert not engine.abort("r2") and not engine.abort("nobody")
    engine.run()
    assert engine.pool.num_free_blocks == 24
    assert requests[0].finish_reason in ("stop", "length")


def test_requests_wait_for_blocks_and_for_the_steps_encoder_budget(tiny_whisper):
    _, _, model = tiny_whisper
    # 300 budget tokens: two encoder passes of 150 positions per step.
    engine = WhisperEngine(model, num_blocks=64, max_num_batched_tokens=300)
    requests = _requests(5)
    for r in requests:
        engine.add(r)
    engine.step()
    assert [r.request_id for r in engine.running] == ["r0", "r1"]
    engine.step()
    assert len(engine.running) + sum(r.finish_reason is not None for r in requests) == 4
    # Blocks: 64 hold all five requests (56); 30 hold r0 and r1 (22), not r2 (12) besides.
    small = WhisperEngine(model, num_blocks=30)
    for r in _requests(5):
        small.add(r)
    small.step()
    assert len(small.running) == 2 and len(small.waiting) == 3
    assert len(small.run()) == 5 and small.pool.num_free_blocks == 30


def test_bad_requests_are_refused_with_what_to_change(tiny_whisper):
    _, _, model = tiny_whisper
    engine = WhisperEngine(model, num_blocks=10)
    good = _requests(1)[0]
    with pytest.raises(
        ValueError, match="needs 11 KV blocks \\(10 for cross-attention\\), the pool has 10"
    ):
        engine.add(good)
    with pytest.raises(ValueError, match=r"features must be \[80, 300\], got \(80, 10\)"):
        engine.add(TranscriptionRequest("x", torch.zeros(80, 10), [3], 4))
    with pytest.raises(ValueError, match="prompt must hold 1 to 63 tokens, got 0"):
        engine.add(TranscriptionRequest("x", good.features, [], 4))
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        engine.add(TranscriptionRequest("x", good.features, [3], 0))


def test_sampling_at_a_temperature_is_seeded(tiny_whisper):
    _, _, model = tiny_whisper

    def sample(seed: int) -> list[list[int]]:
        engine = WhisperEngine(model, num_blocks=64, seed=seed)
        requests = _requests(2)
        for r in requests:
            r.temperature = 1.0
            engine.add(r)
        engine.run()
        return [r.output for r in requests]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def _generate(hf, features: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
    """transformers' `generate` for a batch, each row cut after its end of text."""
    out = hf.generate(features, max_new_tokens=max_new_tokens)
    rows = []
    for row in out.tolist():
        eos = hf.config.eos_token_id
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tokens_equal_transformers_generate_with_suppressed_tokens(tiny_whisper, backend):
    """Three inputs run together give `generate`'s tokens, on the torch backend and on Triton's
    kernels (the interpreter here). The engine suppresses what the generation config says, as
    `generate` does: `begin_suppress_tokens` never first, `suppress_tokens` never. Chosen here
    so that they change the greedy tokens: input 0's first token, and the most frequent one."""
    from pagedserve import kernels

    _, hf, model = tiny_whisper
    features = whisper_features(3, seed=5)
    plain = greedy(model, features, [[3]] * 3, 12)
    first = plain[0][0]
    counts = collections.Counter(t for row in plain for t in row[1:])
    frequent = max(counts, key=lambda t: (counts[t], t))
    config = hf.generation_config
    saved = (config.begin_suppress_tokens, config.suppress_tokens)
    config.begin_suppress_tokens, config.suppress_tokens = [first, 220, 50256], [frequent]
    try:
        expected = _generate(hf, features, 12)
    finally:
        config.begin_suppress_tokens, config.suppress_tokens = saved
    engine = WhisperEngine(model, num_blocks=64, ops=kernels.get_backend(backend),
                           suppress_tokens=[frequent],
                           begin_suppress_tokens=[first, 220, 50256])  # fmt: skip
    requests = [TranscriptionRequest(f"r{i}", features[i], [3], 12) for i in range(3)]
    for r in requests:
        engine.add(r)
    engine.run()
    assert [r.output for r in requests] == expected
    assert expected != plain and expected[0][0] != first
    assert all(frequent not in row for row in expected)
    # Without suppression, `generate` is the plain greedy reference too.
    assert _generate(hf, features, 12) == plain
