"""Model configs from Hugging Face files: a `config.json`'s contents (`config_from_hf_dict`), the
file with its generation_config.json (`config_from_json_file`), and back (`hf_dict_of`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pagedserve.engine.models.model_config import (
    ARCHITECTURE_CLASSES,
    FAMILY_DEFAULTS,
    FULL_ATTENTION,
    GEMMA_ARCHITECTURES,
    HIDDEN_ACTIVATIONS,
    MULTIMODAL_TEXT_MODELS,
    SLIDING_ATTENTION,
    ModelConfig,
)

_CLASS_TO_ARCHITECTURE = {cls: arch for arch, cls in ARCHITECTURE_CLASSES.items()}


def config_from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    """Build from the contents of a Hugging Face `config.json`.

    Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`, `torch_dtype`, no
    `layer_types`) and the transformers 5 ones (`rope_parameters`, per layer type for Gemma
    3; `dtype`; `layer_types`). A multimodal checkpoint of MULTIMODAL_TEXT_MODELS is read as
    its language model; a Whisper checkpoint as its decoder (`WhisperConfig.decoder_model_config`).
    """
    if d.get("model_type") == "whisper":
        from pagedserve.engine.models.whisper_config import WhisperConfig

        return WhisperConfig.from_hf_dict(d).decoder_model_config()
    if d.get("model_type") == "bert":
        from pagedserve.engine.models.bert_config import BertConfig

        return BertConfig.from_hf_dict(d).model_config()
    d = _text_model_of(d)
    arch = _architecture_of(d)
    defaults = FAMILY_DEFAULTS[arch]

    def required(key: str) -> Any:
        if d.get(key) is None:
            raise ValueError(f"config is missing required key {key!r}")
        return d[key]

    gemma = arch in GEMMA_ARCHITECTURES
    # Gemma configs name it hidden_activation (and may carry a stale hidden_act next to it).
    act = (d.get("hidden_activation") or d.get("hidden_act")) if gemma else d.get("hidden_act")
    act = act or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in HIDDEN_ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act!r} is not supported; supported: {', '.join(HIDDEN_ACTIVATIONS)}"
        )
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")

    hidden_size = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    if d.get("head_dim") is not None:
        head_dim = int(d["head_dim"])
    elif hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads "
            f"({num_heads}) and the config gives no head_dim"
        )
    else:
        head_dim = hidden_size // num_heads
    num_kv_heads = d.get("num_key_value_heads")
    num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
    num_layers = int(required("num_hidden_layers"))
    max_positions = int(d.get("max_position_embeddings", defaults["max_position_embeddings"]))

    rope_theta, rope_scaling, local_rope_theta = _rope_of(d, arch, defaults, max_positions)
    layer_types, sliding_window = _layer_types_of(d, arch, num_layers)
    attention_bias = arch == "qwen2" or bool(d.get("attention_bias", False))
    if gemma and attention_bias:
        raise ValueError("attention_bias=True is not supported for Gemma")

    moe: dict[str, Any] = {}
    if arch == "mixtral":
        moe = dict(
            num_experts=int(required("num_local_experts")),
            num_experts_per_tok=int(required("num_experts_per_tok")),
            moe_intermediate_size=int(required("intermediate_size")),
            norm_topk_prob=True,  # Mixtral always renormalises its top-k weights
        )
    elif arch == "qwen3_moe":
        step = int(d.get("decoder_sparse_step", 1))
        dense = set(d.get("mlp_only_layers") or ())
        dense |= {i for i in range(num_layers) if step <= 0 or (i + 1) % step}
        moe = dict(
            num_experts=int(d.get("num_experts", d.get("num_local_experts")) or 0),
            num_experts_per_tok=int(required("num_experts_per_tok")),
            moe_intermediate_size=int(required("moe_intermediate_size")),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            dense_layers=tuple(sorted(dense)),
        )

    def cap(key: str, gemma2_default: float) -> float | None:
        value = d.get(key, gemma2_default if arch == "gemma2" else None)
        return None if value is None else float(value)

    return ModelConfig(
        architecture=arch,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(required("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=float(rope_theta),
        rope_scaling=freeze_rope_scaling(rope_scaling),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        sliding_window=sliding_window,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
        torch_dtype=d.get("torch_dtype", d.get("dtype")),
        layer_types=layer_types,
        hidden_act=act,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
        query_pre_attn_scalar=(
            float(d.get("query_pre_attn_scalar") or head_dim) if gemma else None
        ),
        attn_logit_softcapping=cap("attn_logit_softcapping", 50.0),
        final_logit_softcapping=cap("final_logit_softcapping", 30.0),
        local_rope_theta=local_rope_theta,
        **moe,
    )


def config_from_json_file(path: str | Path) -> ModelConfig:
    """Read a Hugging Face `config.json`, and the ids that end generation in the
    `generation_config.json` next to it: instruction-tuned models often list their
    end-of-turn token only there (Gemma 2's <end_of_turn>, Phi-3's <|end|>), and vLLM and
    transformers' generate() stop at those too."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        config = config_from_hf_dict(json.load(f))
    generation = path.with_name("generation_config.json")
    if path.name != "config.json" or not generation.is_file():
        return config
    with open(generation, encoding="utf-8") as f:
        try:
            extra = _as_id_tuple(json.load(f).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{str(generation)!r} is not a generation config: {e}") from e
    eos = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=eos)


def hf_dict_of(config: ModelConfig) -> dict[str, Any]:
    """A transformers-compatible config dict (`config_from_hf_dict` of it gives back this config).

    Uses the transformers 4 keys (`rope_theta`, `rope_scaling`), which transformers 5 also
    accepts and converts to `rope_parameters`.
    """
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURE_CLASSES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling_dict(),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": (
            config.eos_token_ids[0]
            if len(config.eos_token_ids) == 1
            else list(config.eos_token_ids)
        ),
        "torch_dtype": config.torch_dtype,
        # Not read by pagedserve; some families' defaults (Phi-3's 32000) lie outside a
        # small vocabulary.
        "pad_token_id": None,
    }
    if not config.eos_token_ids:
        d["eos_token_id"] = None
    arch, types = config.architecture, list(config.layer_types)
    if arch in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = config.attention_bias
        d["mlp_bias"] = False
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        # HF's rule slides the layers from max_window_layers on; layer_types says it exactly.
        sliding = [i for i, t in enumerate(types) if t == SLIDING_ATTENTION]
        d["use_sliding_window"] = bool(sliding)
        d["max_window_layers"] = sliding[0] if sliding else config.num_hidden_layers
        d["layer_types"] = types
    elif config.is_gemma:
        d["hidden_activation"] = config.hidden_act
        d["layer_types"] = types
        # transformers' Gemma configs take an int here (all published ones are).
        scalar = config.query_pre_attn_scalar
        d["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
        d["attn_logit_softcapping"] = config.attn_logit_softcapping
        d["final_logit_softcapping"] = config.final_logit_softcapping
        if arch == "gemma3_text":
            full = {"rope_type": "default", **(config.rope_scaling_dict() or {})}
            del d["rope_theta"], d["rope_scaling"]
            d["rope_parameters"] = {
                FULL_ATTENTION: {**full, "rope_theta": config.rope_theta},
                SLIDING_ATTENTION: {
                    "rope_type": "default",
                    "rope_theta": config.local_rope_theta or config.rope_theta,
                },
            }
    if arch == "phi3" and config.rope_scaling_dict():
        d["original_max_position_embeddings"] = config.rope_scaling_dict()[
            "original_max_position_embeddings"
        ]
    if arch == "mixtral":
        d["num_local_experts"] = config.num_experts
        d["num_experts_per_tok"] = config.num_experts_per_tok
        d["intermediate_size"] = config.moe_intermediate_size
    elif arch == "qwen3_moe":
        d["num_experts"] = config.num_experts
        d["num_experts_per_tok"] = config.num_experts_per_tok
        d["moe_intermediate_size"] = config.moe_intermediate_size
        d["norm_topk_prob"] = config.norm_topk_prob
        d["decoder_sparse_step"] = 1
        d["mlp_only_layers"] = list(config.dense_layers)
    d["sliding_window"] = config.sliding_window
    return d


def _architecture_of(d: dict[str, Any]) -> str:
    for cls_name in d.get("architectures") or ():
        if cls_name in _CLASS_TO_ARCHITECTURE:
            return _CLASS_TO_ARCHITECTURE[cls_name]
    if d.get("model_type") in ARCHITECTURE_CLASSES:
        return d["model_type"]
    raise ValueError(
        f"unsupported model: architectures={d.get('architectures')!r}, "
        f"model_type={d.get('model_type')!r}; supported: "
        f"{', '.join(ARCHITECTURE_CLASSES.values())}"
    )


def _text_model_of(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a MULTIMODAL_TEXT_MODELS checkpoint (`d` itself for any
    other). Published ones list only what differs from the defaults (google/gemma-3-4b-it:
    hidden size, layers, window, rope scaling), so the rest comes from transformers' own config
    class; the ids that end generation and the dtype may sit at the top level."""
    wrapper = next((c for c in d.get("architectures") or () if c in MULTIMODAL_TEXT_MODELS), None)
    if wrapper is None:
        return d
    from transformers import AutoConfig

    text = dict(d.get(MULTIMODAL_TEXT_MODELS[wrapper]) or {})
    model_type = text.pop("model_type", None)
    if model_type not in ARCHITECTURE_CLASSES:
        raise ValueError(
            f"{wrapper}'s language model {model_type!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURE_CLASSES)}"
        )
    full = AutoConfig.for_model(model_type, **text).to_dict()
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if d.get(key) is not None:
            full[key] = d[key]
    full["architectures"] = [ARCHITECTURE_CLASSES[model_type]]
    return full


def _layer_types_of(
    d: dict[str, Any], arch: str, num_layers: int
) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention kind and the window of the sliding ones (None when none slides),
    from transformers 5's `layer_types` or, in older configs, the rule each family's model
    applies."""
    window = d.get("sliding_window")
    if d.get("layer_types"):
        types = tuple(d["layer_types"])
    elif arch in ("qwen2", "qwen3", "qwen3_moe"):
        # Layer i slides iff use_sliding_window and i >= max_window_layers.
        first = int(d.get("max_window_layers", num_layers)) if d.get("use_sliding_window") else None
        types = tuple(
            SLIDING_ATTENTION if first is not None and i >= first else FULL_ATTENTION
            for i in range(num_layers)
        )
    elif arch == "gemma2":
        types = tuple(
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
        )
    elif arch == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
        types = tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        )
    else:  # Mistral, Mixtral and Phi-3 slide every layer when a window is set; Llama none.
        slides = arch in ("mistral", "mixtral", "phi3") and window is not None
        types = (SLIDING_ATTENTION if slides else FULL_ATTENTION,) * num_layers
    if window is None or SLIDING_ATTENTION not in types:
        types = (FULL_ATTENTION,) * len(types)
        window = None
    return types, None if window is None else int(window)


def _rope_of(
    d: dict[str, Any], arch: str, defaults: dict[str, Any], max_positions: int
) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own theta or None) of a config."""
    params = d.get("rope_parameters") or {}
    local_theta = d.get("rope_local_base_freq")  # Gemma 3, transformers 4
    if FULL_ATTENTION in params:  # transformers 5 Gemma 3: one set per layer type
        local = params.get(SLIDING_ATTENTION) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope scaling of the sliding layers ({local['rope_type']!r}) is not supported"
            )
        local_theta = local.get("rope_theta", local_theta)
        params = params[FULL_ATTENTION] or {}
    theta = d.get("rope_theta", params.get("rope_theta", defaults["rope_theta"]))
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = dict(scaling) if scaling else None
    partial = d.get("partial_rotary_factor", (scaling or {}).pop("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "su":  # Phi-3's first name for LongRoPE
            kind = "longrope"
        if kind == "longrope":
            scaling["rope_type"] = kind
            scaling.pop("type", None)
            original = scaling.get(
                "original_max_position_embeddings", d.get("original_max_position_embeddings")
            )
            if original is None:
                raise ValueError("longrope scaling needs original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(original)
            scaling.setdefault("factor", max_positions / int(original))
    if local_theta is not None and arch == "gemma3_text":
        return float(theta), scaling, float(local_theta)
    return float(theta), scaling, None


def freeze_rope_scaling(scaling: dict[str, Any] | None) -> tuple[tuple[str, object], ...] | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")  # transformers < 4.45 spelling
    scaling.pop("type", None)
    if scaling.get("rope_type") == "default":
        return None
    return tuple(
        sorted(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items() if v is not None
        )
    )


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))
