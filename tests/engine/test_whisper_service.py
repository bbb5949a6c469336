"""The Whisper serving loop (engine/frontend/whisper_service.py) on the tiny random checkpoint of
tests/conftest.py, and the decoder prompt and languages a model folder's generation config
gives: windows come back with the reference's tokens, a stream left early aborts its windows
and frees their blocks, shutdown fails what is in flight, the waiting-queue limit holds."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from pagedserve.engine.core.whisper_engine import WhisperEngine
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.audio import log_mel
from pagedserve.engine.frontend.client import EngineDeadError, QueueFullError
from pagedserve.engine.frontend.whisper_service import (
    TranscriptionService,
    WhisperDecoding,
    load_whisper,
    plan_blocks,
)
from pagedserve.engine.models import cpu_linear
from pagedserve.engine.models.whisper import greedy
from pagedserve.engine.models.whisper_config import WhisperConfig


def _audio(n: int, seed: int = 0) -> list[np.ndarray]:
    """n windows of 3 s of 16 kHz audio (the tiny model's window): tones under noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(48_000) / 16_000
    return [(0.3 * np.sin(2 * np.pi * (200 + 70 * i) * t)
             + 0.05 * gen.standard_normal(len(t))).astype(np.float32)
            for i in range(n)]  # fmt: skip


def _features(windows: list[np.ndarray]) -> torch.Tensor:
    return log_mel(windows, 80, 300)


def _service(model, num_blocks=64, max_num_seqs=16, max_queue_len=None) -> TranscriptionService:
    engine = WhisperEngine(model, num_blocks, max_num_seqs=max_num_seqs)
    return TranscriptionService(engine, None, WhisperDecoding(decoder_start=3), max_queue_len)


async def _gather(stream) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in stream:
        tokens.setdefault(out.window, []).extend(out.token_ids)
    return tokens


def test_windows_come_back_with_the_reference_tokens(tiny_whisper):
    _, _, model = tiny_whisper
    audio = _audio(5, seed=3)
    features = _features(audio)
    service = _service(model, max_num_seqs=3)  # 5 windows, 3 at a time
    service.start()
    try:

        async def main():
            first = service.submit(audio[:2], [3], 0.0, "a", deltas=False)  # whole windows
            second = service.submit(audio[2:], [3, 10], 0.0, "b")  # tokens after each step
            return await asyncio.gather(_gather(first), _gather(second))

        got_a, got_b = asyncio.run(main())
    finally:
        service.shutdown()
    assert got_a == dict(enumerate(greedy(model, features[:2], [[3]] * 2, 63)))
    assert got_b == dict(enumerate(greedy(model, features[2:], [[3, 10]] * 3, 62)))
    assert service.engine.pool.num_free_blocks == 64
    assert service.num_unfinished_requests == 0
    assert service.stats.num_requests_added == 5 and service.stats.kv_blocks_used == 0


def test_leaving_a_stream_early_aborts_its_windows_and_frees_their_blocks(tiny_whisper):
    _, _, model = tiny_whisper
    service = _service(model, max_num_seqs=1)  # one window at a time: the others wait
    aborted = []
    real_abort = service.engine.abort
    service.engine.abort = lambda rid: aborted.append(rid) or real_abort(rid)
    service.start()
    try:

        async def main():
            stream = service.submit(_audio(3), [3], 0.0, "t")
            async for out in stream:
                assert out.window == 0 and out.finish_reason is None
                break  # the client went away after window 0's first token
            for _ in range(500):
                if not service.num_unfinished_requests and not service.engine.has_unfinished:
                    return
                await asyncio.sleep(0.01)

        asyncio.run(main())
    finally:
        service.shutdown()
    assert aborted == ["t-0", "t-1", "t-2"]
    assert service.engine.pool.num_free_blocks == 64
    assert service.stats.kv_blocks_used == 0 and service.stats.num_waiting == 0


def test_shutdown_ends_the_streams_in_flight_with_an_error(tiny_whisper):
    _, _, model = tiny_whisper
    service = _service(model, max_num_seqs=1)
    service.start()

    async def main():
        stream = service.submit(_audio(3), [3], 0.0, "t")
        outputs = aiter(stream)
        await anext(outputs)
        await asyncio.to_thread(service.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            while True:
                await anext(outputs)
        with pytest.raises(EngineDeadError, match="has stopped"):
            service.submit(_audio(1), [3], 0.0, "late")

    asyncio.run(main())
    assert service.num_unfinished_requests == 0


def test_the_waiting_queue_limit_counts_windows(tiny_whisper):
    _, _, model = tiny_whisper
    service = _service(model, max_queue_len=4)  # not started: everything submitted waits

    async def main():
        service._running = True  # accept requests without a loop taking them
        service.submit(_audio(3), [3], 0.0, "a")
        service.submit(_audio(1), [3], 0.0, "b")  # 3 windows wait: room for more
        with pytest.raises(QueueFullError, match=r"full \(4 windows of audio wait"):
            service.submit(_audio(1), [3], 0.0, "c")

    asyncio.run(main())


def test_a_request_the_engine_cannot_run_is_refused_before_queueing(tiny_whisper):
    _, _, model = tiny_whisper
    service = _service(model, num_blocks=10)  # a request needs 10 + 4 blocks
    service._running = True

    async def main():
        with pytest.raises(ValueError, match="needs 14 KV blocks .* the pool has 10"):
            service.submit(_audio(1), [3], 0.0, "a")

    asyncio.run(main())
    assert service._commands.empty() and service.num_unfinished_requests == 0


# ---- decoding settings ------------------------------------------------------------------------

LARGE_V3_LIKE = {
    "is_multilingual": True,
    "lang_to_id": {"<|en|>": 50259, "<|de|>": 50261},
    "task_to_id": {"transcribe": 50360, "translate": 50359},
    "no_timestamps_token_id": 50364,
    "prev_sot_token_id": 50362,
    "suppress_tokens": [1, 2, 7],
    "begin_suppress_tokens": [220, 50257],
}


def _decoding(tmp_path, generation: dict, config: dict | None = None) -> WhisperDecoding:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return WhisperDecoding.of(tmp_path, WhisperConfig(**_LARGE_V3_SHAPE))


_LARGE_V3_SHAPE = dict(
    vocab_size=51866, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=128,
    max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258,
    eos_token_id=50257,
)  # fmt: skip


def test_a_multilingual_models_prompt_names_language_task_and_no_timestamps(tmp_path):
    d = _decoding(tmp_path, LARGE_V3_LIKE, {"suppress_tokens": [99], "begin_suppress_tokens": []})
    assert d.suppress_tokens == (1, 2, 7)  # generation_config.json wins over config.json
    assert d.begin_suppress_tokens == (220, 50257)
    assert d.language(None) == "en" and d.language("German") == "de" and d.language("DE") == "de"
    assert d.prompt("de", [], 448) == [50258, 50261, 50360, 50364]
    # A client's prompt follows <|startofprev|>, its last 223 tokens kept (448 // 2 - 1).
    previous = list(range(1000, 1300))
    assert d.prompt("en", previous, 448) == [50362, *range(1077, 1300), 50258, 50259, 50360, 50364]
    with pytest.raises(ValueError, match="no token for language 'fr'"):
        d.language("fr")
    with pytest.raises(ValueError, match="'klingon' is not one Whisper knows"):
        d.language("klingon")


def test_an_english_only_model_refuses_other_languages(tmp_path):
    d = _decoding(tmp_path, {"is_multilingual": False, "no_timestamps_token_id": 50363})
    assert d.language("english") == "en"
    assert d.prompt("en", [], 448) == [50258, 50363]
    with pytest.raises(ValueError, match="English only, not 'de'"):
        d.language("de")


def test_a_model_without_language_tokens_starts_from_decoder_start(tiny_whisper):
    folder, _, _ = tiny_whisper
    model, tokenizer, d = load_whisper(EngineConfig(model=str(folder), dtype="float32"))
    assert d == WhisperDecoding(decoder_start=3, begin_suppress_tokens=(220, 50256))
    assert d.language("fr") == "fr"  # known, and nothing in the prompt to change
    assert d.prompt("fr", [40, 41], 64) == [40, 41, 3]
    assert tokenizer.is_synthetic and len(tokenizer) == 300
    assert next(model.parameters()).dtype == torch.float32
    # Matmul weights pre-packed for oneDNN where it can (engine/models/cpu_linear.py).
    packs = cpu_linear.can_pack(torch.device("cpu"), torch.float32)
    assert cpu_linear.is_packed(model.model.decoder.embed_tokens.weight) == packs
    assert cpu_linear.is_packed(model.model.encoder.layers[0].fc1.weight) == packs


def test_blocks_planned_for_the_requests_that_can_run(tiny_whisper):
    folder, _, ours = tiny_whisper
    c = ours.config  # 10 cross + 4 self blocks per request; K and V x 2 layers x 16 x 64 x 4 B
    assert plan_blocks(EngineConfig(model=str(folder), max_num_seqs=5), c, torch.float32) == 70
    memory = EngineConfig(model=str(folder), kv_cache_memory=16384 * 30)
    assert plan_blocks(memory, c, torch.float32) == 30
    explicit = EngineConfig(model=str(folder), num_kv_blocks=17)
    assert plan_blocks(explicit, c, torch.float32) == 17


def test_a_transcription_that_fails_to_start_fails_alone(tiny_whisper):
    """Features are made on the loop's thread: a window they cannot be made of (here a 3-D
    array) fails its own transcription; the loop and the next one go on."""
    _, _, model = tiny_whisper
    service = _service(model)
    service.start()
    try:

        async def main():
            bad = service.submit([np.zeros((2, 2, 2), np.float32)], [3], 0.0, "bad")
            with pytest.raises(ValueError):
                await _gather(bad)
            return await _gather(service.submit(_audio(1), [3], 0.0, "good"))

        got = asyncio.run(main())
    finally:
        service.shutdown()
    assert got == dict(enumerate(greedy(model, _features(_audio(1)), [[3]], 63)))
    assert service.engine.pool.num_free_blocks == 64 and service.num_unfinished_requests == 0
