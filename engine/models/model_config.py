"""Model configuration for the decoder families pagedserve runs: Llama (2/3, SmolLM2), Qwen2/2.5,
Mistral, Qwen3, Gemma 2, Gemma 3 (text), Phi-3, and the mixtures of experts Mixtral and Qwen3-MoE.

`ModelConfig` is the one description of a model's shapes that the rest of the engine reads. It is
frozen and validated on construction. It is read from a Hugging Face config.json
(engine/models/hf_config.py), from GGUF metadata (engine/models/gguf_config.py) or from a
built-in shape's published values (engine/models/builtin_shapes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.scheduler.kv_groups import KVCacheGroup, group_layers

if TYPE_CHECKING:
    from pagedserve.engine.models.bert_config import BertConfig
    from pagedserve.engine.models.whisper_config import WhisperConfig

# The rope_scaling types engine/models/rotary.py implements, with the keys each needs. ModelConfig
# refuses any other type when the config is read, so the model never sees one.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # ModelConfig fills in `factor` (max_position_embeddings / original) when a config leaves it
    # out, as transformers does.
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
}
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
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Multimodal checkpoints whose language model pagedserve serves alone (text in, text out): the
# class -> the config key of its language model. Their weights load through the prefixes of
# engine/models/weights.py `MULTIMODAL_PREFIXES`.
MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "text_config"}

# Defaults of the Hugging Face config classes, used when a config.json leaves a key out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
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
    type the model implements (`ROPE_SCALING_KEYS`) with the keys it needs,
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
    # An encoder-decoder (architecture "whisper"): its whole configuration. The fields above
    # describe its decoder (WhisperConfig.decoder_model_config), which holds the paged KV.
    whisper: WhisperConfig | None = None
    # An encoder-only model (architecture "bert", an embedding model): its whole configuration.
    bert: BertConfig | None = None

    def __post_init__(self) -> None:
        if self.whisper is not None:
            if self.architecture != "whisper":
                raise ValueError(f"a Whisper config with architecture {self.architecture!r}")
        elif self.bert is not None:
            if self.architecture != "bert":
                raise ValueError(f"a BERT config with architecture {self.architecture!r}")
        elif self.architecture not in ARCHITECTURE_CLASSES:
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
        if self.whisper is None and self.bert is None and self.hidden_act not in HIDDEN_ACTIVATIONS:
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
    def is_encoder_decoder(self) -> bool:
        """Whisper: requests carry audio the encoder turns into cross-attention KV."""
        return self.whisper is not None

    @property
    def is_encoder_only(self) -> bool:
        """BERT: an embedding model whose tokens attend both ways; it keeps no KV."""
        return self.bert is not None

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
