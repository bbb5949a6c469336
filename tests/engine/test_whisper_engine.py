"""Whisper through the one engine (engine/core, scheduler/, engine/worker) on the tiny random
checkpoint of tests/conftest.py: transcription requests (AudioPrompts) are scheduled like any
other, each holding its cross-attention blocks from admission to its end (the scheduler's
encoder blocks, drawn from the same pool, shown in the block map), so they batch, preempt and
recompute, and their tokens equal the reference's greedy decoding and transformers' `generate`
whatever the batch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.inputs import AudioPrompt, InputProcessor
from pagedserve.engine.frontend.llm_engine import LLMEngine
from pagedserve.engine.models.whisper import WhisperModel, greedy
from pagedserve.engine.models.whisper_features import log_mel
from pagedserve.scheduler import SamplingParams
from pagedserve.scheduler.kv_cache_manager import KVCacheManager
from tests.helpers import whisper_audio

PROMPTS = [[3], [3, 10], [3, 10, 11, 12, 13], [3, 7], [3, 8, 9]]
# 150 encoder positions in blocks of 16: 10 cross-attention blocks per request; then the
# self-attention blocks of the prompt + 12 new tokens: 1 block for prompts of up to 4 tokens, 2
# for the 5-token prompt.
CROSS_BLOCKS = 10


def _engine(folder, **options) -> LLMEngine:
    """(A pool of 128 blocks, 9 full-length requests: the default's 4 GiB takes seconds to zero.)"""
    return LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", **{"num_kv_blocks": 128, **options})
    )


def _run(engine: LLMEngine, audio, prompts=PROMPTS, max_tokens=12, **params) -> list[list[int]]:
    """Every request's tokens, in request order."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    for i, (samples, prompt) in enumerate(zip(audio, prompts, strict=False)):
        engine.add_request(f"r{i}", AudioPrompt(prompt, samples), sampling)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return [outputs[f"r{i}"] for i in range(len(outputs))]


def _reference(model, audio, prompts=PROMPTS, max_tokens=12) -> list[list[int]]:
    return greedy(model, log_mel(audio, 80, 300), prompts[: len(audio)], max_tokens)


@pytest.mark.parametrize("max_num_seqs", [5, 2])
def test_tokens_equal_the_reference_in_any_batch(tiny_whisper, max_num_seqs):
    folder, _, model = tiny_whisper
    audio = whisper_audio(5, seed=2)
    engine = _engine(folder, max_num_seqs=max_num_seqs)
    assert _run(engine, audio) == _reference(model, audio)
    kv = engine.core.scheduler.kv_cache_manager
    assert kv.num_used_blocks == 0 and engine.core.scheduler.num_preemptions == 0


def test_cross_blocks_are_allocated_once_at_admission_shown_and_freed(tiny_whisper, monkeypatch):
    folder, _, model = tiny_whisper
    engine = _engine(folder, num_kv_blocks=64)
    calls = []
    real = KVCacheManager.allocate_encoder_blocks
    monkeypatch.setattr(
        KVCacheManager,
        "allocate_encoder_blocks",
        lambda self, request, n: calls.append((request.request_id, n)) or real(self, request, n),
    )
    audio = whisper_audio(3, seed=2)
    for i in range(3):
        engine.add_request(f"r{i}", AudioPrompt(PROMPTS[i], audio[i]), SamplingParams(
            temperature=0.0, max_tokens=12))  # fmt: skip
    engine.step()
    assert calls == [("0:r0", 10), ("0:r1", 10), ("0:r2", 10)]  # all admitted at once
    kv_map = json.loads(engine.kv_map())
    requests = {r["id"]: r for r in kv_map["requests"]}
    assert [len(requests[f"0:r{i}"]["encoder_block_ids"]) for i in range(3)] == [10] * 3
    assert [len(requests[f"0:r{i}"]["block_ids"]) for i in range(3)] == [1, 1, 1]
    held = {b for r in requests.values() for b in r["encoder_block_ids"] + r["block_ids"]}
    assert len(held) == 33 and kv_map["totals"]["used_blocks"] == 33
    assert all(kv_map["owners"][str(b)] == [rid] for rid, r in requests.items()
               for b in r["encoder_block_ids"])  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) == 3  # nothing allocated for the encoder while decoding
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_preempted_transcription_recomputes_with_the_same_tokens(tiny_whisper, monkeypatch):
    """A pool of 24 blocks holds two requests (10 cross-attention blocks and 1 to 3 of their
    own each) and not all their growth: the latest admitted is preempted, gives back both kinds
    of blocks, and is encoded again when it is readmitted."""
    folder, _, model = tiny_whisper
    encoded = []
    real = WhisperModel.encode_into_cache
    monkeypatch.setattr(
        WhisperModel,
        "encode_into_cache",
        lambda self, audio, *rest: encoded.extend(audio) or real(self, audio, *rest),
    )
    audio = whisper_audio(5, seed=2)
    engine = _engine(folder, num_kv_blocks=24)
    assert _run(engine, audio, max_tokens=40) == _reference(model, audio, max_tokens=40)
    assert engine.core.scheduler.num_preemptions >= 2
    assert len(encoded) == 5 + engine.core.scheduler.num_preemptions  # each readmission encodes
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_abort_frees_both_kinds_of_blocks_of_a_running_and_a_waiting_request(tiny_whisper):
    folder, _, _ = tiny_whisper
    engine = _engine(folder, num_kv_blocks=24)  # room for r0 and r1 (11 each), not r2
    audio = whisper_audio(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i in range(3):
        engine.add_request(f"r{i}", AudioPrompt(PROMPTS[i], audio[i]), params)
    engine.step()
    scheduler = engine.core.scheduler
    assert [r.request_id for r in scheduler.running] == ["0:r0", "0:r1"]
    assert [r.request_id for r in scheduler.waiting] == ["0:r2"]
    assert scheduler.kv_cache_manager.num_free_blocks == 2
    assert engine.abort("r1").outputs[0].finish_reason == "abort"
    assert scheduler.kv_cache_manager.num_free_blocks == 13
    engine.abort("r2")
    assert not scheduler.waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert scheduler.kv_cache_manager.num_free_blocks == 24


def test_requests_wait_for_the_steps_encoder_budget(tiny_whisper):
    """An admission costs its encoder's 150 positions of the step's token budget (every step
    admits at least one): with 310 tokens, two requests a step."""
    folder, _, model = tiny_whisper
    engine = _engine(folder, max_num_batched_tokens=310)
    audio = whisper_audio(5, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i in range(5):
        engine.add_request(f"r{i}", AudioPrompt(PROMPTS[i], audio[i]), params)
    engine.step()
    assert engine.core.scheduler.num_running == 2 and engine.core.scheduler.num_waiting == 3
    engine.step()
    assert engine.core.scheduler.num_running == 4 and engine.core.scheduler.num_waiting == 1
    # A budget below one encoder pass still admits one a step.
    small = _engine(folder, max_num_batched_tokens=100)
    assert _run(small, audio) == _reference(model, audio)


def test_bad_requests_are_refused_with_what_to_change(tiny_whisper):
    folder, _, _ = tiny_whisper
    engine = _engine(folder)
    params = SamplingParams(max_tokens=4)
    window = whisper_audio(1)[0]
    with pytest.raises(ValueError, match=r"1 to 48000 samples .*got shape \(48001,\)"):
        engine.add_request("a", AudioPrompt([3], np.zeros(48_001, np.float32)), params)
    with pytest.raises(ValueError, match="this is a Whisper model: it transcribes audio"):
        engine.add_request("b", [3, 4], params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("c", AudioPrompt([], window), params)
    with pytest.raises(ValueError, match="prompt has 64 tokens but max_model_len is 64"):
        engine.add_request("d", AudioPrompt([3] * 64, window), params)
    with pytest.raises(ValueError, match="an audio request samples one sequence"):
        engine.add_request("e", AudioPrompt([3], window), SamplingParams(n=2))
    assert not engine.has_unfinished_requests()
    text_model = InputProcessor(None, 64, 300)  # a decoder-only model's checks
    with pytest.raises(ValueError, match="this model takes no audio"):
        text_model.process_prompt(AudioPrompt([3], window))
    with pytest.raises(ValueError, match=r"served without --tensor-parallel-size > 1, "
                       "--speculative-ngram: drop them"):  # fmt: skip
        EngineConfig(
            model=str(folder), tensor_parallel_size=2, speculative_ngram=3
        ).check_encoder_model("Whisper")


def test_sampling_at_a_temperature_is_seeded(tiny_whisper):
    folder, _, _ = tiny_whisper
    audio = whisper_audio(2, seed=2)

    def sample(seed: int) -> list[list[int]]:
        engine = _engine(folder, seed=seed)
        for i in range(2):
            engine.add_request(f"r{i}", AudioPrompt([3], audio[i]), SamplingParams(
                temperature=1.0, max_tokens=12, ignore_eos=True))  # fmt: skip
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step())
        return [outputs["r0"], outputs["r1"]]

    first = sample(1)
    assert [len(t) for t in first] == [12, 12]
    assert sample(1) == first
    assert sample(2) != first


def _generate(hf, features, max_new_tokens: int) -> list[list[int]]:
    """transformers' `generate` for a batch, each row cut after its end of text."""
    out = hf.generate(features, max_new_tokens=max_new_tokens)
    eos = hf.config.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out.tolist()]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tokens_equal_transformers_generate_with_suppressed_tokens(tiny_whisper, tmp_path, backend):
    """Three inputs run together give `generate`'s tokens, on the torch backend and on Triton's
    kernels (the interpreter here). The engine suppresses what the folder's generation config
    says, as `generate` does: `begin_suppress_tokens` never first, `suppress_tokens` never.
    Chosen here so that they change the greedy tokens: input 0's first token, and the most
    frequent one."""
    folder, hf, model = tiny_whisper
    audio = whisper_audio(3, seed=5)
    features = log_mel(audio, 80, 300)
    plain = greedy(model, features, [[3]] * 3, 12)
    first = plain[0][0]
    later = [t for row in plain for t in row[1:]]
    frequent = max(set(later), key=lambda t: (later.count(t), t))
    config = hf.generation_config
    saved = (config.begin_suppress_tokens, config.suppress_tokens)
    config.begin_suppress_tokens, config.suppress_tokens = [first, 220, 50256], [frequent]
    try:
        expected = _generate(hf, features, 12)
        suppressing = tmp_path / "whisper"
        shutil.copytree(folder, suppressing)
        config.save_pretrained(suppressing)  # generation_config.json
    finally:
        config.begin_suppress_tokens, config.suppress_tokens = saved
    engine = _engine(suppressing, attention_backend=backend)
    assert _run(engine, audio, [[3]] * 3) == expected
    assert expected != plain and expected[0][0] != first
    assert all(frequent not in row for row in expected)
    # Without suppression, `generate` is the plain greedy reference too.
    assert _generate(hf, features, 12) == plain
