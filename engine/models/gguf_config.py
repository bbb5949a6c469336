"""Model configs from GGUF metadata, read as llama.cpp reads it (`config_from_gguf`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.engine.models.hf_config import freeze_rope_scaling
from pagedserve.engine.models.model_config import (
    FAMILY_DEFAULTS,
    FULL_ATTENTION,
    GEMMA_ARCHITECTURES,
    SLIDING_ATTENTION,
    ModelConfig,
)
from pagedserve.engine.models.rotary import rope_attention_factor, rope_inv_freq

if TYPE_CHECKING:
    import gguf

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
# What llama.cpp assumes when a GGUF file leaves them out: Gemma 2's window, and which layers of
# a Gemma slide (every n-th layer, counting from 1, attends to everything; `_gguf_layer_types`).
GGUF_DEFAULT_WINDOWS = {"gemma2": 4096}
GGUF_SLIDING_PATTERNS = {"gemma2": 2, "gemma3_text": 6}
# Generation ends at these tokens of a GGUF file, as in llama.cpp: the ids the metadata names,
# and every token spelled like an end of turn (llama.cpp finds them by their text: Gemma files
# name only <eos> though chat turns end with <end_of_turn>, Phi-3 files only <|endoftext|>
# though turns end with <|end|>).
GGUF_END_OF_GENERATION_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
GGUF_END_OF_TURN_TEXTS = frozenset(
    text.encode()
    for text in (
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
    )
)  # fmt: skip


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """Build from the metadata (and tensor list) of a GGUF file, as llama.cpp reads it.

    Where llama.cpp's converter leaves a fact out of the metadata, this reads it the way
    llama.cpp does: embeddings are tied when there is no `output.weight` tensor; a
    `rope_freqs.weight` tensor (Llama 3 rope scaling) is turned back into HF's llama3
    rope_scaling, and Phi-3's `rope_factors_long/short` tensors into longrope; Mixtral is a
    "llama" file with experts; the layers of a mixture of experts that have no router
    (`ffn_gate_inp`) are dense; Gemma's sliding layers follow llama.cpp's default pattern
    and its score scale the 27B rule, unless the file says otherwise.
    """
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    gguf_arch = get("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    p = gguf_arch  # the metadata keys' prefix

    def need(key: str) -> Any:
        value = get(f"{p}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata is missing {p}.{key}")
        return value

    num_experts = int(get(f"{p}.expert_count") or 0)
    arch = GGUF_ARCHITECTURES[gguf_arch]
    if arch == "llama" and num_experts:
        arch = "mixtral"
    hidden_size = int(need("embedding_length"))
    num_layers = int(need("block_count"))
    num_heads = _single_value(need("attention.head_count"), "attention.head_count")
    num_kv_heads = _single_value(
        get(f"{p}.attention.head_count_kv", num_heads), "attention.head_count_kv"
    )
    head_dim = get(f"{p}.attention.key_length", get(f"{p}.rope.dimension_count"))
    head_dim = hidden_size // num_heads if head_dim is None else int(head_dim)
    tensors = {t.name: t for t in reader.tensors}

    vocab_size = get(f"{p}.vocab_size")
    if vocab_size is None:
        if "tokenizer.ggml.tokens" in fields:
            vocab_size = len(fields["tokenizer.ggml.tokens"].data)
        elif "token_embd.weight" in tensors:
            vocab_size = int(tensors["token_embd.weight"].shape[-1])
        else:
            raise ValueError(f"GGUF has neither {p}.vocab_size nor tokenizer.ggml.tokens")
    max_positions = int(get(f"{p}.context_length", 2048))

    rope_theta = _f32(get(f"{p}.rope.freq_base", FAMILY_DEFAULTS[arch]["rope_theta"]))
    rope_scaling: dict[str, Any] | None = None
    scaling_type = get(f"{p}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type}
        if (factor := get(f"{p}.rope.scaling.factor")) is not None:
            rope_scaling["factor"] = _f32(factor)
        if (orig := get(f"{p}.rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif "rope_factors_long.weight" in tensors:
        rope_scaling = _longrope_from_gguf(
            tensors, get(f"{p}.rope.scaling.original_context_length"), max_positions,
            get(f"{p}.rope.scaling.attn_factor"),
        )  # fmt: skip
    elif "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"]
        rope_scaling = _llama3_rope_scaling_from_freqs(
            [float(x) for x in freqs.data.reshape(-1)], head_dim, rope_theta
        )

    eos_ids: list[int] = []
    for key in GGUF_END_OF_GENERATION_KEYS:
        token_id = get(key)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    eos_ids += [i for i in _gguf_end_of_turn_tokens(fields) if i not in eos_ids]
    bos = get("tokenizer.ggml.bos_token_id")

    window = get(f"{p}.attention.sliding_window")
    window = GGUF_DEFAULT_WINDOWS.get(arch) if window is None else int(window) or None
    # Without a pattern every layer slides (Mistral, Phi-3) when there is a window.
    pattern = get(f"{p}.attention.sliding_window_pattern", GGUF_SLIDING_PATTERNS.get(arch))
    layer_types: tuple[str, ...] = ()
    if window is not None and pattern is not None:
        layer_types = _gguf_layer_types(pattern, num_layers)
    gemma: dict[str, Any] = {}
    if arch in GEMMA_ARCHITECTURES:
        gemma = dict(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=_gemma_query_scalar(
                arch,
                num_layers,
                hidden_size // num_heads,
                head_dim,
                get(f"{p}.attention.scale"),
            ),
            attn_logit_softcapping=_f32_or_none(
                get(f"{p}.attn_logit_softcapping", 50.0 if arch == "gemma2" else None)
            ),
            final_logit_softcapping=_f32_or_none(
                get(f"{p}.final_logit_softcapping", 30.0 if arch == "gemma2" else None)
            ),
        )
        if arch == "gemma3_text" and SLIDING_ATTENTION in layer_types:
            # llama.cpp's default for Gemma 3's sliding layers when the file has none.
            gemma["local_rope_theta"] = _f32(get(f"{p}.rope.freq_base_swa", 10000.0))
    moe: dict[str, Any] = {}
    intermediate_size = _single_value(need("feed_forward_length"), "feed_forward_length")
    if num_experts:
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=int(get(f"{p}.expert_feed_forward_length", intermediate_size)),
            # llama.cpp renormalises the top-k weights of both families unless told otherwise.
            norm_topk_prob=bool(get(f"{p}.expert_weights_norm", True)),
            dense_layers=tuple(
                i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
            ),
        )

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=freeze_rope_scaling(rope_scaling),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        sliding_window=window,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        torch_dtype=None,
        layer_types=layer_types,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **gemma,
        **moe,
    )


def _gguf_layer_types(pattern: int | list[bool], num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind from a GGUF `attention.sliding_window_pattern`: one bool per
    layer (True: sliding), or a period n where layer i slides unless i % n == n - 1 (n = 0: all
    slide), as llama.cpp's `set_swa_pattern` reads it."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"GGUF sliding_window_pattern has {len(pattern)} entries for {num_layers} layers"
            )
        slides = [bool(b) for b in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in slides)


def _gguf_end_of_turn_tokens(fields: dict[str, Any]) -> list[int]:
    """Ids of the vocabulary's tokens spelled like an end of turn (GGUF_END_OF_TURN_TEXTS)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    # Compared as bytes, without decoding every string of a large vocabulary.
    return [
        i
        for i, part in enumerate(tokens.data)
        if bytes(tokens.parts[part]) in GGUF_END_OF_TURN_TEXTS
    ]


def _gemma_query_scalar(
    arch: str, num_layers: int, hidden_per_head: int, head_dim: int, scale: float | None
) -> float:
    """Gemma's query_pre_attn_scalar for a GGUF file, which stores at most the scale itself:
    llama.cpp uses hidden_size / num_heads for the 27B models (46 layers for Gemma 2, 62 for
    Gemma 3, as their configs say) and head_dim for the others."""
    if scale is not None:
        return float(np.float32(scale)) ** -2
    is_27b = num_layers == {"gemma2": 46, "gemma3_text": 62}[arch]
    return float(hidden_per_head if is_27b else head_dim)


def _longrope_from_gguf(
    tensors: dict[str, Any], original: int | None, max_positions: int, attn_factor: float | None
) -> dict[str, Any]:
    """Phi-3's LongRoPE from llama.cpp's `rope_factors_long/short` tensors and metadata (its
    converter writes no scaling type for them). The attention factor is kept only when it is not
    the one transformers computes from the factor."""
    if original is None:
        raise ValueError(
            "GGUF has rope_factors tensors but no rope.scaling.original_context_length"
        )
    if "rope_factors_short.weight" not in tensors:
        raise ValueError("GGUF has rope_factors_long.weight but no rope_factors_short.weight")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "original_max_position_embeddings": int(original),
        "factor": max_positions / int(original),
    }
    for kind in ("long", "short"):
        values = tensors[f"rope_factors_{kind}.weight"].data.reshape(-1)
        scaling[f"{kind}_factor"] = [_f32(x) for x in values]
    if attn_factor is not None:
        computed = rope_attention_factor(scaling)
        if not math.isclose(float(attn_factor), computed, rel_tol=1e-6):
            scaling["attention_factor"] = _f32(attn_factor)
    return scaling


def _f32_or_none(value: float | None) -> float | None:
    return None if value is None else _f32(value)


def _single_value(value: Any, key: str) -> int:
    """GGUF allows per-layer arrays for some counts; we need them uniform."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer {key} {value} is not supported (must be uniform)")
        value = value[0]
    return int(value)


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _llama3_rope_scaling_from_freqs(
    freqs: list[float], head_dim: int, rope_theta: float
) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's `rope_freqs` tensor.

    The converter stores, per rotary frequency, the divisor llama3 scaling applies. Its largest
    value is `factor`; the other parameters are not stored, so we take the values every Llama
    3.1/3.2/3.3 release uses and check that they reproduce the tensor.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": max(freqs),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # llama.cpp's divisors are plain RoPE's frequencies over the scaled ones.
    plain = rope_inv_freq(head_dim, rope_theta, None)
    expected = (plain / rope_inv_freq(head_dim, rope_theta, scaling)).tolist()
    if len(expected) != len(freqs) or any(
        not math.isclose(a, b, rel_tol=1e-4) for a, b in zip(expected, freqs, strict=False)
    ):
        raise ValueError(
            "GGUF rope_freqs tensor does not match llama3 rope scaling with low_freq_factor=1, "
            "high_freq_factor=4, original_max_position_embeddings=8192; load this model from its "
            "Hugging Face folder instead"
        )
    return scaling
