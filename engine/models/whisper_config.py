"""Whisper's configuration (`WhisperForConditionalGeneration` folders and the built-in shapes),
whether a model is Whisper (`whisper_config_of`), the view of its decoder the engine sizes and
schedules (`WhisperConfig.decoder_model_config`), what its folder says about decoding
(`WhisperDecoding`: the decoder prompt's special tokens, the tokens `generate` suppresses). The
model itself is engine/models/whisper.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine.models.model_config import ModelConfig

WHISPER_ARCHITECTURE = "WhisperForConditionalGeneration"
SAMPLE_RATE = 16_000  # Whisper's audio: 16 kHz samples
HOP_LENGTH = 160  # samples between feature frames: one frame every 10 ms
# A client's prompt (previous text) keeps at most this share of the decoder's positions, its last
# tokens: Whisper's own limit (max_target_positions // 2 - 1 = 223 of 448), as transformers'.
_PROMPT_SHARE = 2


@dataclass(frozen=True)
class WhisperConfig:
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int  # encoder positions (1500: 30 s of audio)
    max_target_positions: int  # decoder positions (448)
    decoder_start_token_id: int
    eos_token_id: int
    scale_embedding: bool = False

    def __post_init__(self) -> None:
        for heads, name in ((self.encoder_attention_heads, "encoder"),
                            (self.decoder_attention_heads, "decoder")):  # fmt: skip
            if self.d_model % heads:
                raise ValueError(
                    f"d_model {self.d_model} is not divisible by the {name}'s {heads} heads"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @property
    def num_frames(self) -> int:
        """Feature frames the encoder takes: 2 per position (the second convolution's stride)."""
        return 2 * self.max_source_positions

    @property
    def window_seconds(self) -> float:
        """Seconds of audio one encoder pass covers, a frame every 10 ms (Whisper's 1500
        positions: 30 s)."""
        return self.num_frames / 100

    @property
    def window_samples(self) -> int:
        """The most audio samples (16 kHz) one request's encoder pass takes."""
        return self.num_frames * HOP_LENGTH

    def decoder_model_config(self) -> ModelConfig:
        """The decoder as the engine sizes, schedules and samples it: its layers hold the
        self-attention KV (full attention, a head per query), its positions bound a request, its
        end of text ends one. `whisper` carries the rest (the encoder, the cross-attention)."""
        from pagedserve.engine.models.model_config import ModelConfig

        return ModelConfig(
            architecture="whisper",
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            intermediate_size=self.decoder_ffn_dim,
            num_hidden_layers=self.decoder_layers,
            num_attention_heads=self.decoder_attention_heads,
            num_key_value_heads=self.decoder_attention_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-5,  # (Whisper's LayerNorm eps; no RMSNorm)
            rope_theta=1.0,  # (no RoPE: learned positions)
            rope_scaling=None,
            max_position_embeddings=self.max_target_positions,
            tie_word_embeddings=True,
            attention_bias=True,
            sliding_window=None,
            bos_token_id=None,
            eos_token_ids=(self.eos_token_id,),
            hidden_act="gelu",
            whisper=self,
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> WhisperConfig:
        if d.get("model_type") != "whisper":
            raise ValueError(f"not a Whisper config (model_type {d.get('model_type')!r})")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        activation = d.get("activation_function", "gelu")
        if activation != "gelu":
            raise ValueError(f"Whisper with activation {activation!r} is not supported (gelu)")
        names = ("vocab_size", "d_model", "encoder_layers", "decoder_layers",
                 "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
                 "decoder_ffn_dim", "num_mel_bins", "max_source_positions",
                 "max_target_positions", "decoder_start_token_id")  # fmt: skip
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"Whisper config lacks {', '.join(missing)}")
        return cls(
            **{n: int(d[n]) for n in names},
            eos_token_id=int(eos),
            scale_embedding=bool(d.get("scale_embedding", False)),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> WhisperConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


# Built-in shapes (random weights, for plans and benchmarks): transformers' configs of the models.
WHISPER_SHAPES = {
    "whisper-large-v3": dict(
        vocab_size=51866, d_model=1280, encoder_layers=32, decoder_layers=32,
        encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120,
        decoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
    ),
    "whisper-tiny": dict(
        vocab_size=51865, d_model=384, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
        decoder_ffn_dim=1536, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
    ),
    "whisper-small": dict(
        vocab_size=51865, d_model=768, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
        decoder_ffn_dim=3072, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
    ),
}  # fmt: skip


def whisper_config_of(model: str) -> WhisperConfig | None:
    """The WhisperConfig of `model` (a built-in shape, a folder or a config.json file) when it is
    a Whisper model, else None."""
    if model in WHISPER_SHAPES:
        return WhisperConfig(**WHISPER_SHAPES[model])
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    if config_file.suffix != ".json" or not config_file.is_file():
        return None
    with open(config_file, encoding="utf-8") as f:
        d = json.load(f)
    return WhisperConfig.from_hf_dict(d) if d.get("model_type") == "whisper" else None


def _languages() -> tuple[dict[str, str], dict[str, str]]:
    """(code -> name, name or alias -> code): transformers' table of Whisper's languages."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return LANGUAGES, TO_LANGUAGE_CODE


@dataclass(frozen=True)
class WhisperDecoding:
    """The decoder prompt's special tokens and the suppressed tokens, from the folder's
    generation_config.json (config.json's fields, where it has none), as transformers'
    `generate` reads them. A model without them (a tiny test model, a built-in shape) starts
    from decoder_start_token_id alone."""

    decoder_start: int
    multilingual: bool = False
    english_only: bool = False  # an ".en" model: its config says is_multilingual false
    lang_to_id: dict[str, int] | None = None  # "<|en|>" -> id
    transcribe_id: int | None = None
    no_timestamps_id: int | None = None
    prev_id: int | None = None  # <|startofprev|>: the client's prompt follows it
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: str) -> WhisperDecoding:
        """The settings of `model` (a folder, its config.json, or a built-in shape)."""
        config = whisper_config_of(model)
        if config is None:
            raise ValueError(f"{model!r} is not a Whisper model")
        path = Path(model)
        folder = path if path.is_dir() else path.parent if path.is_file() else None
        fields: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):  # the latter wins
            file = folder / name if folder is not None else None
            if file is not None and file.is_file():
                with open(file, encoding="utf-8") as f:
                    fields.update({k: v for k, v in json.load(f).items() if v is not None})
        lang_to_id = fields.get("lang_to_id") or None
        return cls(
            decoder_start=config.decoder_start_token_id,
            multilingual=bool(fields.get("is_multilingual", False)) and lang_to_id is not None,
            english_only=fields.get("is_multilingual") is False,
            lang_to_id=lang_to_id,
            transcribe_id=(fields.get("task_to_id") or {}).get("transcribe"),
            no_timestamps_id=fields.get("no_timestamps_token_id"),
            prev_id=fields.get("prev_sot_token_id"),
            suppress_tokens=tuple(fields.get("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(fields.get("begin_suppress_tokens") or ()),
        )

    def language(self, language: str | None) -> str:
        """The ISO-639-1 code of a request's `language` (a code or an English name, any case;
        none: "en", as vLLM defaults). ValueError for a language Whisper does not know or this
        model cannot transcribe."""
        names, codes = _languages()
        if language is None or not language.strip():
            return "en"
        wanted = language.strip().lower()
        code = wanted if wanted in names else codes.get(wanted)
        if code is None:
            raise ValueError(
                f"language {language!r} is not one Whisper knows; give an ISO-639-1 code such "
                "as en, de, fr or zh"
            )
        if self.multilingual and f"<|{code}|>" not in self.lang_to_id:
            raise ValueError(f"this model has no token for language {code!r}")
        if self.english_only and code != "en":
            raise ValueError(f"this model transcribes English only, not {code!r}")
        return code  # (a model without language tokens: the prompt does not name it)

    def prompt(
        self, language: str, previous_text_ids: Sequence[int], max_positions: int
    ) -> list[int]:
        """The decoder prompt: the client's prompt (after <|startofprev|>, its last tokens), then
        <|startoftranscript|>, and for a multilingual model <|lang|><|transcribe|>, then
        <|notimestamps|> (pagedserve does not predict timestamps)."""
        head = [self.decoder_start]
        if self.multilingual:
            head.append(self.lang_to_id[f"<|{language}|>"])
            if self.transcribe_id is not None:
                head.append(self.transcribe_id)
        if self.no_timestamps_id is not None:
            head.append(self.no_timestamps_id)
        previous: list[int] = []
        if previous_text_ids:
            keep = max_positions // _PROMPT_SHARE - 1
            previous = ([self.prev_id] if self.prev_id is not None else []) + list(
                previous_text_ids
            )[-keep:]
        return previous + head
