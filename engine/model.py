"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Mistral) reading its KV cache in pages.

Reads top to bottom: embedding -> N x (RMSNorm -> attention -> RMSNorm -> SwiGLU MLP) -> norm.
q/k/v and gate/up projections are stored stacked (one matmul each); `load_weights` maps Hugging
Face parameter names onto the stacked tensors.

Everything between the matmuls is a call into the backend module `ops` (`kernels.reference` in
torch, `kernels.triton_ops` in Triton): RMSNorm, residual add + RMSNorm, rotary embedding + the
KV-cache write, paged attention, SiLU-and-multiply. As in vLLM, the residual stream travels next
to the hidden states, so that each residual add is fused into the norm that follows it:

    h, r = x, x                       layer i:  h, r = add_rms_norm(h, r)   (r += h; h = norm(r))
    h = norm(h)                                 h = attention(h)
                                                h, r = add_rms_norm(h, r)
                                                h = mlp(h)
    after the last layer: h, _ = add_rms_norm(h, r)  (the final norm)
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.attention_metadata import AttentionMetadata
from engine.cpu_linear import linear, pack
from engine.model_config import ModelConfig
from engine.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache): [num_blocks, block_size, Hkv, D]


def _empty(*shape: int) -> nn.Parameter:
    # Parameters are filled by load_weights; skipping random init keeps start-up cheap.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as transformers does. With a
    residual, adds x to it first (in place) and returns (normalised, the updated residual)."""

    def __init__(self, hidden_size: int, eps: float, ops: ModuleType = kernels) -> None:
        super().__init__()
        self.ops = ops
        self.weight = _empty(hidden_size)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """`ops` is the backend module (`kernels.reference`, `kernels.triton_ops`, or the `kernels`
    dispatcher itself): `rotary_and_cache` and `paged_attention` here."""

    def __init__(self, config: ModelConfig, ops: ModuleType = kernels) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.sliding_window
        self.qkv_proj = _empty(self.q_size + 2 * self.kv_size, config.hidden_size)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_proj = _empty(config.hidden_size, self.q_size)

    def forward(
        self,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        k_cache, v_cache = kv_cache
        # Rotate q and k and write this step's K/V first: the new tokens attend to themselves
        # through the cache.
        q = self.ops.rotary_and_cache(
            qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping,
            self.num_heads, self.num_kv_heads, self.head_dim,
        )  # fmt: skip
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
        )
        return linear(out.reshape(n, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType = kernels) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _empty(2 * config.intermediate_size, config.hidden_size)
        self.down_proj = _empty(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.ops.silu_and_mul(linear(x, self.gate_up_proj)), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType = kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with residual None).
        Returns this layer's MLP output and the residual stream before it is added."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, rotary, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The whole model. forward() returns hidden states of every token; compute_logits() projects
    only the rows the sampler needs (one per sequence that samples this step) and, for requests
    that asked for prompt logprobs, the rows of the prompt positions they score.

    `attention_ops` is the backend module every layer calls (see the module docstring)."""

    def __init__(
        self, config: ModelConfig, max_positions: int, attention_ops: ModuleType = kernels
    ) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling_dict()
        )
        self.embed_tokens = _empty(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention_ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attention_ops)
        self.lm_head = (
            None if config.tie_word_embeddings else _empty(config.vocab_size, config.hidden_size)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, self.rotary, x, residual, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, weight).float()

    def pack_linear_weights(self) -> None:
        """Pre-pack every matmul weight for oneDNN (bf16 on CPU; see engine/cpu_linear.py)."""
        for layer in self.layers:
            for weight in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                pack(weight)
        pack(self.embed_tokens if self.lm_head is None else self.lm_head)

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (stacked) parameters; every parameter must be
        written exactly once or a ValueError names what is missing or unexpected."""
        targets = self._weight_targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embedding anyway
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param, offset = target
            rows = tensor.shape[0] if tensor.dim() else 0
            dest = param.data.narrow(0, offset, min(rows, param.shape[0] - offset))
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def _weight_targets(self) -> dict[str, tuple[nn.Parameter, int]]:
        """HF name -> (parameter, row offset inside it)."""
        c = self.config
        q, kv, inter = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        )
        targets: dict[str, tuple[nn.Parameter, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0),
            "model.norm.weight": (self.norm.weight, 0),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = (self.lm_head, 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0)
            targets[p + "post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight,
                0,
            )
            for proj, offset in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
                targets[p + f"self_attn.{proj}.weight"] = (attn.qkv_proj, offset)
                if attn.qkv_bias is not None:
                    targets[p + f"self_attn.{proj}.bias"] = (attn.qkv_bias, offset)
            targets[p + "self_attn.o_proj.weight"] = (attn.o_proj, 0)
            targets[p + "mlp.gate_proj.weight"] = (mlp.gate_up_proj, 0)
            targets[p + "mlp.up_proj.weight"] = (mlp.gate_up_proj, inter)
            targets[p + "mlp.down_proj.weight"] = (mlp.down_proj, 0)
        return targets
