"""Embedding models: BERT's configuration (an encoder-only `BertModel` folder), how a model's
hidden states become one vector (`PoolingConfig`, from sentence-transformers' files where the
folder has them) and whether an engine embeds (`embedding_pooling`). No torch here: the API
server reads these too. The model itself is engine/models/bert.py; the pooling, the engine's
pooler (engine/worker/pooler.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine.models.model_config import ModelConfig
    from pagedserve.engine.models.model_source import ModelSource

BERT_ARCHITECTURE = "BertModel"
POOLING_MODES = ("cls", "mean", "last")
# sentence-transformers' Pooling config keys -> our mode; any other mode set there is refused.
_ST_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")  # fmt: skip
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_POOLING = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by the "
                f"{self.num_attention_heads} attention heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BertConfig:
        if d.get("model_type") != "bert":
            raise ValueError(f"not a BERT config (model_type {d.get('model_type')!r})")
        if d.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT with hidden_act {d['hidden_act']!r} is not supported (gelu)")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT with position_embedding_type {d['position_embedding_type']!r} is not "
                "supported (absolute)"
            )
        if d.get("is_decoder"):
            raise ValueError("a BERT decoder (is_decoder) is not supported: only the encoder")
        names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "max_position_embeddings")  # fmt: skip
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"BERT config lacks {', '.join(missing)}")
        return cls(
            **{n: int(d[n]) for n in names},
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(d.get("pad_token_id") or 0),
        )

    def model_config(self) -> ModelConfig:
        """The view the engine sizes and schedules: its positions bound a request. It keeps no
        KV (engine/worker/worker.py allocates none for it); `bert` carries the rest."""
        from pagedserve.engine.models.model_config import ModelConfig

        return ModelConfig(
            architecture="bert",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.layer_norm_eps,  # (LayerNorm's eps; no RMSNorm)
            rope_theta=1.0,  # (no RoPE: learned positions)
            rope_scaling=None,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            attention_bias=True,
            sliding_window=None,
            bos_token_id=None,
            eos_token_ids=(),
            hidden_act="gelu",
            bert=self,
        )


@dataclass(frozen=True)
class PoolingConfig:
    """How an embedding model turns a prompt's last hidden states into one vector: the CLS
    (first) token's, the mean over the tokens, or the last token's; L2-normalised or not; the
    longest prompt it takes (sentence-transformers' max_seq_length, when it says); the output
    sizes it was trained to be cut to (Matryoshka; empty: only its full size)."""

    mode: str
    normalize: bool
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] = ()
    # Any size from 1 up (the config says is_matryoshka without listing sizes).
    any_dimensions: bool = False

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r}; supported: {', '.join(POOLING_MODES)}")

    def allows_dimensions(self, dimensions: int, hidden_size: int) -> bool:
        if not 0 < dimensions <= hidden_size:
            return False
        return self.any_dimensions or dimensions in (*self.matryoshka_dimensions, hidden_size)

    @classmethod
    def of_folder(cls, folder: Path, default_mode: str) -> PoolingConfig:
        """sentence-transformers' files in `folder` (modules.json, its Pooling module's
        config.json, sentence_bert_config.json), else `default_mode` and normalised; the
        Matryoshka sizes from config.json's `matryoshka_dimensions` or `is_matryoshka`."""
        mode, normalize = default_mode, True
        modules = _read_json(folder / "modules.json")
        if isinstance(modules, list):
            types = {m.get("type"): m for m in modules if isinstance(m, dict)}
            normalize = _ST_NORMALIZE in types
            pooling = types.get(_ST_POOLING)
            if pooling is not None:
                mode = _st_pooling_mode(folder / pooling.get("path", "") / "config.json")
        sbert = _read_json(folder / "sentence_bert_config.json") or {}
        max_seq_length = sbert.get("max_seq_length")
        config = _read_json(folder / "config.json") or {}
        dims = config.get("matryoshka_dimensions") or ()
        return cls(
            mode,
            normalize,
            int(max_seq_length) if max_seq_length else None,
            tuple(int(d) for d in dims),
            any_dimensions=bool(config.get("is_matryoshka")) and not dims,
        )


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e


def _st_pooling_mode(path: Path) -> str:
    d = _read_json(path) or {}
    unsupported = [k for k in _ST_UNSUPPORTED_KEYS if d.get(k)]
    modes = [mode for key, mode in _ST_POOLING_KEYS.items() if d.get(key)]
    if unsupported or len(modes) != 1:
        raise ValueError(
            f"{str(path)!r}: pooling must be exactly one of "
            f"{', '.join(_ST_POOLING_KEYS)}; got {[*modes, *unsupported] or 'none'}"
        )
    return modes[0]


def context_length(config: ModelConfig, pooling: PoolingConfig | None) -> int:
    """The longest request the model takes: its positions, or for an embedding model that
    says so (sentence-transformers' max_seq_length) that many tokens."""
    if pooling is not None and pooling.max_seq_length:
        return min(config.max_position_embeddings, pooling.max_seq_length)
    return config.max_position_embeddings


def is_embedding_model(source: ModelSource) -> bool:
    """An encoder-only model, or a folder sentence-transformers loads (modules.json)."""
    folder = source.path if source.kind == "hf_dir" else None
    return source.config.bert is not None or (
        folder is not None and (folder / "modules.json").is_file()
    )


def embedding_pooling(source: ModelSource, task: str) -> PoolingConfig | None:
    """The pooling an engine of `task` (EngineConfig.task; "auto": from the model) runs for
    this model, or None when it generates. ValueError for a task the model cannot do."""
    embeds = is_embedding_model(source) if task == "auto" else task == "embed"
    if not embeds:
        if source.config.bert is not None:
            raise ValueError(
                f"model {source.name!r} is an encoder ({BERT_ARCHITECTURE}): it cannot "
                "generate text; serve it with --task embed (or auto)"
            )
        return None
    if source.config.is_encoder_decoder:
        raise ValueError("a Whisper model transcribes audio: --task embed does not apply")
    # An encoder's sentence vector is its CLS token's unless it says otherwise; a decoder's is
    # its last token's (the only one that saw the whole prompt).
    default_mode = "cls" if source.config.bert is not None else "last"
    if source.kind == "hf_dir" and source.path is not None:
        return PoolingConfig.of_folder(source.path, default_mode)
    return PoolingConfig(default_mode, normalize=True)
