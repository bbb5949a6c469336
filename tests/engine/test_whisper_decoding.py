"""What a Whisper model's folder says about decoding (engine/models/whisper_config.py
`WhisperDecoding`): the decoder prompt's special tokens, the languages, the suppressed tokens; and
how the worker builds a Whisper model and plans its KV cache (cross-attention blocks per
request beside the self-attention ones)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.llm_engine import LLMEngine
from pagedserve.engine.models import cpu_linear
from pagedserve.engine.models.whisper_config import WhisperDecoding

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
    fields = {"model_type": "whisper", **_LARGE_V3_SHAPE, **(config or {})}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return WhisperDecoding.of(str(tmp_path))


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
    d = WhisperDecoding.of(str(folder))
    assert d == WhisperDecoding(decoder_start=3, begin_suppress_tokens=(220, 50256))
    assert d.language("fr") == "fr"  # known, and nothing in the prompt to change
    assert d.prompt("fr", [40, 41], 64) == [40, 41, 3]
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64))
    assert engine.tokenizer.is_synthetic and len(engine.tokenizer) == 300
    model = engine.core.worker.model
    assert next(model.parameters()).dtype == torch.float32
    # transformers' default config suppresses 220 and 50256 first; 50256 is past the vocabulary.
    first, later = engine.core.worker.runner._suppress_masks
    assert [t for t in range(300) if not first[t // 32] >> (t % 32) & 1] == [220]
    assert (later == -1).all()
    # Matmul weights pre-packed for oneDNN where it can (engine/models/cpu_linear.py).
    packs = cpu_linear.can_pack(torch.device("cpu"), torch.float32)
    assert cpu_linear.is_packed(model.model.decoder.embed_tokens.weight) == packs
    assert cpu_linear.is_packed(model.model.encoder.layers[0].fc1.weight) == packs


def test_the_kv_plan_holds_each_requests_cross_attention_blocks(tiny_whisper):
    folder, _, _ = tiny_whisper
    # K and V x 2 layers x 16 tokens x 64 x 4 bytes per block; a request holds 10 blocks for its
    # 150 encoder positions and up to 4 for its 64 decoder positions.
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=16384 * 70))
    plan = engine.core.worker.kv_plan
    assert (plan.num_blocks, plan.bytes_per_block, plan.encoder_blocks) == (70, 16384, 10)
    assert plan.blocks_per_seq == 14 and plan.max_concurrency == 5.0
    assert "(10 of a request's for its encoder's cross-attention)" in plan.describe()
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=64 tokens"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=13))
