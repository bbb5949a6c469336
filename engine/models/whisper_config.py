"""Whisper's configuration (`WhisperForConditionalGeneration` folders and the built-in shapes),
whether a model is Whisper (`whisper_config_of`), and its KV plan for `pagedserve kv-plan`. The
model itself is engine/models/whisper.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WHISPER_ARCHITECTURE = "WhisperForConditionalGeneration"


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


def kv_plan_report(
    name: str,
    config: WhisperConfig,
    dtype: torch.dtype,
    num_seqs: int,
    max_tokens: int,
    block_size: int,
) -> str:
    """`pagedserve kv-plan` for Whisper: the decoder's self-attention KV, which grows a token at a
    time in the normal paged blocks, and the cross-attention KV, written once per request from
    the encoder's `max_source_positions` states into a KV group of its own, in bytes and
    blocks."""
    L, d, s, P = config.decoder_layers, config.d_model, dtype.itemsize, config.max_source_positions
    per_token = 2 * L * d * s
    cross = per_token * P
    self_blocks, cross_blocks = -(-max_tokens // block_size), -(-P // block_size)
    total = num_seqs * (max_tokens * per_token + cross)
    return "\n".join([
        f"model: {name} (whisper), {L} decoder layers, d_model {d} "
        f"({config.decoder_attention_heads} heads x {config.head_dim}), "
        f"dtype {str(dtype).removeprefix('torch.')} ({s} bytes)",
        f"self-attention, per token: 2 x {L} layers x {d} x {s} = {per_token} bytes "
        f"({per_token / 1024:.1f} KiB)",
        f"self-attention, per request of {max_tokens} tokens: {max_tokens * per_token} bytes "
        f"({max_tokens * per_token / 2**20:.1f} MiB), {self_blocks} blocks of {block_size}",
        f"cross-attention, per request ({P} encoder positions, written once): {P} x {per_token} = "
        f"{cross} bytes ({cross / 2**20:.1f} MiB), {cross_blocks} blocks of {block_size}",
        f"total for {num_seqs} requests: {total} bytes ({total / 2**30:.3f} GiB), "
        f"{num_seqs * (self_blocks + cross_blocks)} blocks; cross-attention is "
        f"{cross / (max_tokens * per_token + cross):.0%} of it",
    ])  # fmt: skip
