"""The decoder of every family pagedserve runs (Llama 2/3, SmolLM2, Qwen2/2.5/3, Mistral, Gemma 2/3,
Phi-3, and the mixtures of experts Mixtral and Qwen3-MoE), reading its KV cache in pages.

Reads top to bottom: embedding -> N x (RMSNorm -> attention -> RMSNorm -> MLP or experts) ->
norm. q/k/v and gate/up projections are stored stacked (one matmul each), a mixture's experts as
[E, 2 * I, hidden] and [E, hidden, I] tensors; `load_weights` maps Hugging Face parameter names
(per-expert ones too) onto the stacked tensors. What a family adds is read from its ModelConfig:
per-head q/k norms (Qwen3, Gemma 3), Gemma's (1 + weight) norms, extra norms after attention
and the MLP, scaled embeddings, soft-capped scores and logits, and each layer's window and RoPE
base.

Everything between the matmuls is a call into the backend module `ops` (`kernels.reference` in
torch, `kernels.triton_ops` in Triton): RMSNorm, residual add + RMSNorm, rotary embedding + the
KV-cache write, paged attention, the gated activations, the experts. As in vLLM, the residual
stream travels next to the hidden states, so that each residual add is fused into the norm that
follows it:

    h, r = x, x                       layer i:  h, r = add_rms_norm(h, r)   (r += h; h = norm(r))
    h = norm(h)                                 h = attention(h)
                                                h, r = add_rms_norm(h, r)
                                                h = mlp(h)
    after the last layer: h, _ = add_rms_norm(h, r)  (the final norm)

Gemma's extra norms sit on the branch outputs before their adds: h = post_attention_norm(
attention(h)), then h, r = add_rms_norm(h, r) with the pre-feedforward norm, and h =
post_feedforward_norm(mlp(h)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.compiled_step import CompiledStep
from pagedserve.engine.models.cpu_linear import linear, pack
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.parallel import TPGroup, TPShard
from pagedserve.engine.models.quantized_linear import (
    BlockWeight,
    QuantizedRows,
    attach,
    quantized,
)
from pagedserve.engine.models.rotary import RotaryEmbedding
from pagedserve.kernels.backend import KernelBackend

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache): [num_blocks, block_size, Hkv, D]

# ModelConfig.hidden_act -> the backend op of the gated MLP (and the experts' activation name).
_ACT_AND_MUL = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}
_EXPERT_ACTIVATION = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _reduce(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A row-parallel matmul's output: each rank holds a partial sum, the all-reduce the total."""
    return x if tp is None else tp.all_reduce(x)


def _empty(*shape: int) -> nn.Parameter:
    # Parameters are filled by load_weights; skipping random init keeps start-up cheap.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as transformers does (Gemma's
    `unit_offset` norm multiplies by 1 + weight in float32 instead). With a residual, adds x to
    it first (in place) and returns (normalised, the updated residual)."""

    def __init__(
        self, hidden_size: int, eps: float, ops: KernelBackend = kernels, unit_offset: bool = False
    ) -> None:
        super().__init__()
        self.ops = ops
        self.weight = _empty(hidden_size)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)
        return self.ops.fused_add_rms_norm(
            x, residual, self.weight, self.eps, unit_offset=self.unit_offset
        )


class Attention(nn.Module):
    """`ops` is the backend module (`kernels.reference`, `kernels.triton_ops`, or the `kernels`
    dispatcher itself): `rotary_and_cache` and `paged_attention` here."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        kv_group: int,
        ops: KernelBackend = kernels,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp  # tensor parallel: this rank's heads (config is its slice), o row-parallel
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer)
        self.kv_group = kv_group  # which of the step's block tables and slot mappings it reads
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = _empty(self.q_size + 2 * self.kv_size, config.hidden_size)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_proj = _empty(config.hidden_size, self.q_size)
        # An fp8 KV cache's scales (kernels/fp8.py): float32 tensors the kernels read at every
        # call, so that setting them in place (checkpoint, calibration) reaches captured CUDA
        # graphs too. Passed to the kernels only with an fp8 cache (`use_kv_cache_dtype`).
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.kv_scales: dict[str, torch.Tensor] = {}
        # Set for the first step: take the scales from its K and V (`calibrate_kv_scales`).
        self.calibrate_dtype: torch.dtype | None = None
        # LoRA adapters' deltas on the projections (engine/lora/layers.py), when the engine
        # serves adapters: set by the worker's LoRAManager.
        self.qkv_lora = self.o_lora = None
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, config.is_gemma)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, config.is_gemma)

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
        if self.qkv_lora is not None:
            self.qkv_lora.add(qkv, x)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        k_cache, v_cache = kv_cache
        if self.calibrate_dtype is not None:
            self._calibrate(qkv)
        # Rotate q and k and write this step's K/V first: the new tokens attend to themselves
        # through the cache.
        q = self.ops.rotary_and_cache(
            qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache,
            meta.slot_mapping[self.kv_group], self.num_heads, self.num_kv_heads, self.head_dim,
            **self.kv_scales,
        )  # fmt: skip
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables[self.kv_group],
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            **self.kv_scales,
        )
        out = out.reshape(n, self.q_size)
        y = linear(out, self.o_proj)
        if self.o_lora is not None:
            self.o_lora.add(y, out)
        return _reduce(y, self.tp)

    def _calibrate(self, qkv: torch.Tensor) -> None:
        """Set the K and V scales from this step's largest magnitudes (`kv_scale_from_amax`:
        they land at half the format's range). K is taken before RoPE, which rotates pairs and
        can grow an element by sqrt(2) at most: the range's other half covers that."""
        k, v = qkv[:, self.q_size :].split(self.kv_size, dim=1)
        self.k_scale.copy_(kernels.kv_scale_from_amax(k.abs().amax(), self.calibrate_dtype))
        self.v_scale.copy_(kernels.kv_scale_from_amax(v.abs().amax(), self.calibrate_dtype))
        self.calibrate_dtype = None

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's and Gemma 3's RMSNorm over each q and k head (before RoPE), v untouched."""
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=1)
        q = self.q_norm(q.reshape(n * self.num_heads, d)).view(n, self.q_size)
        k = self.k_norm(k.reshape(n * self.num_kv_heads, d)).view(n, self.kv_size)
        return torch.cat((q, k, v), dim=1)


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU-tanh (Gemma's
    GeGLU)."""

    def __init__(
        self, config: ModelConfig, ops: KernelBackend = kernels, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp  # tensor parallel: this rank's share of the width, down row-parallel
        self.act_and_mul = _ACT_AND_MUL[config.hidden_act]
        self.gate_up_proj = _empty(2 * config.intermediate_size, config.hidden_size)
        self.down_proj = _empty(config.hidden_size, config.intermediate_size)
        self.gate_up_lora = self.down_lora = None  # LoRA deltas, as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act_and_mul = getattr(self.ops, self.act_and_mul)
        if self.gate_up_lora is None:
            return _reduce(
                linear(act_and_mul(linear(x, self.gate_up_proj)), self.down_proj), self.tp
            )
        gate_up = linear(x, self.gate_up_proj)
        self.gate_up_lora.add(gate_up, x)
        h = act_and_mul(gate_up)
        y = linear(h, self.down_proj)
        self.down_lora.add(y, h)
        return _reduce(y, self.tp)


class MoE(nn.Module):
    """A mixture of experts: the router picks each token's top-k experts (`ops.moe_route`), and
    `ops.fused_moe` runs them and sums their outputs by the routing weights."""

    def __init__(self, config: ModelConfig, ops: KernelBackend = kernels) -> None:
        super().__init__()
        self.ops = ops
        e, inter, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.activation = _EXPERT_ACTIVATION[config.hidden_act]
        self.round_weights = config.routing_weights_in_dtype
        self.router = _empty(e, h)
        self.gate_up = _empty(e, 2 * inter, h)
        self.down = _empty(e, h, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route(linear(x, self.router), self.top_k, self.renormalize)
        if self.round_weights and x.dtype != torch.float32:
            weights = weights.to(x.dtype).float()
        return self.ops.fused_moe(
            x, self.gate_up, self.down, weights, ids, activation=self.activation
        )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        kv_group: int,
        ops: KernelBackend = kernels,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        h, eps, gemma = config.hidden_size, config.rms_norm_eps, config.is_gemma
        self.input_layernorm = RMSNorm(h, eps, ops, gemma)
        self.self_attn = Attention(config, layer, kv_group, ops, tp)
        self.post_attention_layernorm = RMSNorm(h, eps, ops, gemma)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ops, gemma) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, ops, gemma) if gemma else None
        self.mlp = MoE(config, ops) if config.is_moe_layer(layer) else MLP(config, ops, tp)

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
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class CausalLM(nn.Module):
    """The whole model. forward() returns hidden states of every token; compute_logits() projects
    only the rows the sampler needs (one per sequence that samples this step) and, for requests
    that asked for prompt logprobs, the rows of the prompt positions they score.

    `attention_ops` is the backend module every layer calls (see the module docstring).

    Tensor parallel (`shard` and `tp`, engine/models/parallel.py): the layers are this rank's slice
    (`config` becomes `shard.local_config`), the embedding and lm_head its `shard.vocab_rows`
    rows of the vocabulary; the other ranks must run the same calls at the same time."""

    is_encoder_decoder = False  # (engine/models/whisper.py is one)

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        attention_ops: KernelBackend = kernels,
        shard: TPShard | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.shard, self.tp = shard, tp
        if shard is not None:
            config = shard.local_config(config)
        vocab_rows = config.vocab_size if shard is None else shard.vocab_rows
        self.config = config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling_dict()
        )
        # Gemma 3's sliding layers rotate with a base of their own, unscaled.
        self.local_rotary = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, max_positions, config.local_rope_theta
            )
        self.embed_tokens = _empty(vocab_rows, config.hidden_size)
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model's dtype first.
        self.embed_scale = math.sqrt(config.hidden_size) if config.is_gemma else None
        group_of = {
            layer: g for g, group in enumerate(config.kv_cache_groups()) for layer in group.layers
        }
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, group_of[i], attention_ops, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attention_ops, config.is_gemma)
        self.lm_head = (
            None if config.tie_word_embeddings else _empty(vocab_rows, config.hidden_size)
        )
        # load_weights': parameter storage -> (the parameter's view they fill, the rows).
        self._quantized_rows: dict[int, list[tuple[torch.Tensor, QuantizedRows]]] = {}
        # The layers as one compiled call (compiled_step.py), set by the worker where it applies.
        self.compiled_step: CompiledStep | None = None

    def rotary_of(self, layer: DecoderLayer) -> RotaryEmbedding:
        if self.local_rotary is not None and layer.self_attn.sliding_window is not None:
            return self.local_rotary
        return self.rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * float(torch.tensor(self.embed_scale, dtype=x.dtype))
        if self.compiled_step is not None and self.compiled_step.takes(x, meta, kv_caches):
            return self.compiled_step(x, positions, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, self.rotary_of(layer), x, residual, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            kept = quantized(self.embed_tokens)  # a tied embedding kept quantized
            if kept is not None:
                return kept.embedding(input_ids, self.embed_tokens.dtype)
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: ids outside this rank's rows look up zeros; the sum over the ranks
        # holds each id's one real row.
        local = input_ids - self.shard.vocab[0]
        outside = (local < 0) | (local >= self.shard.vocab[1] - self.shard.vocab[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab]. Tensor parallel: every rank scores its vocabulary rows,
        rank 0 gets the whole and the other ranks None."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        cap = self.config.final_logit_softcapping
        logits = linear(hidden, weight, float_out=cap is None and self.tp is None)
        if cap is not None:  # Gemma 2, in the model's dtype as transformers caps
            logits = torch.tanh(logits / cap) * cap
        if self.tp is not None:  # gathered in the model's dtype: half the bytes of float32
            gathered = self.tp.gather_logits(logits, self.vocab_size)
            return None if gathered is None else gathered.float()
        return logits.float()

    def use_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Give every layer's cache calls its K and V scales when the cache is fp8 (nothing
        otherwise: the kernels' plain path)."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.kv_scales = (
                {"k_scale": attn.k_scale, "v_scale": attn.v_scale} if kernels.is_fp8(dtype) else {}
            )

    def calibrate_kv_scales(self, dtype: torch.dtype) -> None:
        """Have each layer set its fp8 scales from the K and V of the next forward pass (the
        first real step's; --calculate-kv-scales)."""
        for layer in self.layers:
            layer.self_attn.calibrate_dtype = dtype

    def matmul_weights(self) -> list[nn.Parameter]:
        """The dense matmul weights `linear` multiplies by: q/k/v, o, the MLP's gate/up and down
        per layer, and the lm_head (the embedding when tied). The experts' stacked weights are not
        among them (`fused_moe` reads them)."""
        weights = []
        for layer in self.layers:
            weights += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(layer.mlp, MLP):
                weights += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        weights.append(self.embed_tokens if self.lm_head is None else self.lm_head)
        return weights

    def prepare_matmul_weights(self, *, pack_dense: bool) -> list[BlockWeight]:
        """After `load_weights`: keep quantized each matmul weight whose rows all came quantized
        (engine/models/quantized_linear.py; a tied embedding's lookups read its blocks too),
        freeing its dense values; pre-pack the others for oneDNN when `pack_dense` (bf16 and
        float32 on CPU; see engine/models/cpu_linear.py). Returns the weights kept quantized."""
        kept = []
        for param in self.matmul_weights():
            rows = self._quantized_rows.pop(param.untyped_storage().data_ptr(), [])
            # Views of a fused weight (q/k/v, gate/up) start at increasing addresses.
            rows.sort(key=lambda view_rows: view_rows[0].data_ptr())
            if rows and sum(r.shape[0] for _, r in rows) == param.shape[0]:
                weight = BlockWeight(QuantizedRows.stack([r for _, r in rows]))
                attach(param, weight)
                kept.append(weight)
                continue
            for view, part in rows:  # beside dense parts: dequantized like them
                view.copy_(part.dequantize())
            if pack_dense:
                pack(param)
        for leftover in self._quantized_rows.values():  # weights `linear` does not multiply
            for view, part in leftover:
                view.copy_(part.dequantize())
        self._quantized_rows.clear()
        return kept

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        """Copy Hugging Face-named tensors into the (stacked) parameters; every parameter must be
        written exactly once or a ValueError names what is missing or unexpected. Quantized rows
        (a GGUF file's, engine/models/weights.py `iter_gguf_weights(keep_quantized=True)`) are
        checked like the others and kept for `prepare_matmul_weights`, which writes them
        dequantized only where it does not keep them: the dense values of a kept weight are never
        written, so its pages are never touched and the process holds the blocks alone."""
        targets = self._weight_targets()
        self._quantized_rows = {}
        kv_scales = self._kv_scale_targets()
        shapes = self.config.weight_shapes()
        for name, param in (("model.embed_tokens.weight", self.embed_tokens),
                            ("lm_head.weight", self.lm_head)):  # fmt: skip
            if name in shapes:  # a rank's vocabulary rows (the whole, without a shard)
                shapes[name] = tuple(param.shape)
        filled = dict.fromkeys(shapes, 0)
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embedding anyway
            rows = tensor if isinstance(tensor, QuantizedRows) else None
            if rows is not None:
                tensor = torch.empty(rows.shape, device="meta")  # the shape, for the checks
            if name in kv_scales:
                if tensor.numel() != 1:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}: a KV-cache "
                        "scale is one number per layer (per-head scales are not supported)"
                    )
                for scale in kv_scales[name]:
                    scale.copy_(tensor.reshape(1))
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__} "
                    f"({self.config.architecture})"
                )
            key, dest = target
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            filled[key] += tensor.numel()
            if rows is None:
                dest.copy_(tensor)
            else:
                storage = dest.untyped_storage().data_ptr()
                self._quantized_rows.setdefault(storage, []).append((dest, rows))
        missing = [key for key, n in filled.items() if n < math.prod(shapes[key])]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def _kv_scale_targets(self) -> dict[str, list[torch.Tensor]]:
        """Checkpoint name -> the fp8 KV-cache scales it sets, as quantized checkpoints store
        them (vLLM's names): `self_attn.k_scale` / `v_scale`, or one `kv_scale` for both. A
        checkpoint without them leaves 1.0; without an fp8 cache they are not used."""
        targets: dict[str, list[torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            p, attn = f"model.layers.{i}.self_attn.", layer.self_attn
            targets[p + "k_scale"] = [attn.k_scale]
            targets[p + "v_scale"] = [attn.v_scale]
            targets[p + "kv_scale"] = [attn.k_scale, attn.v_scale]
        return targets

    def _weight_targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Checkpoint name -> (the `ModelConfig.weight_shapes` name it is (part of), the view of
        the parameter it is copied into). Besides transformers' own names, a mixture of experts
        takes each expert's tensors apart: Mixtral's `block_sparse_moe.experts.E.w1/w3/w2` and
        Qwen3-MoE's `mlp.experts.E.gate_proj/up_proj/down_proj`, as their checkpoints store
        them, and the stacked gate and up halves apart, as GGUF files store them."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        targets: dict[str, tuple[str, torch.Tensor]] = {}

        def add(name: str, param: torch.Tensor, offset: int = 0, rows: int | None = None) -> None:
            view = param.data if rows is None else param.data.narrow(0, offset, rows)
            targets[name] = (name, view)

        def part(name: str, of: str, view: torch.Tensor) -> None:
            targets[name] = (of, view)

        add("model.embed_tokens.weight", self.embed_tokens)
        add("model.norm.weight", self.norm.weight)
        if self.lm_head is not None:
            add("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ):
                if getattr(layer, norm) is not None:
                    add(p + f"{norm}.weight", getattr(layer, norm).weight)
            if c.architecture == "phi3":
                add(p + "self_attn.qkv_proj.weight", attn.qkv_proj)
            else:
                for proj, offset, rows in (
                    ("q_proj", 0, q),
                    ("k_proj", q, kv),
                    ("v_proj", q + kv, kv),
                ):
                    add(p + f"self_attn.{proj}.weight", attn.qkv_proj, offset, rows)
                    if attn.qkv_bias is not None:
                        add(p + f"self_attn.{proj}.bias", attn.qkv_bias, offset, rows)
            if attn.q_norm is not None:
                add(p + "self_attn.q_norm.weight", attn.q_norm.weight)
                add(p + "self_attn.k_norm.weight", attn.k_norm.weight)
            add(p + "self_attn.o_proj.weight", attn.o_proj)
            if isinstance(mlp, MoE):
                self._expert_targets(p, mlp, add, part)
            elif c.architecture == "phi3":
                add(p + "mlp.gate_up_proj.weight", mlp.gate_up_proj)
                add(p + "mlp.down_proj.weight", mlp.down_proj)
            else:
                inter = c.intermediate_size
                add(p + "mlp.gate_proj.weight", mlp.gate_up_proj, 0, inter)
                add(p + "mlp.up_proj.weight", mlp.gate_up_proj, inter, inter)
                add(p + "mlp.down_proj.weight", mlp.down_proj)
        return targets

    def _expert_targets(
        self, p: str, moe: MoE, add: Callable[..., None], part: Callable[..., None]
    ) -> None:
        inter = self.config.moe_intermediate_size
        gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
        add(p + "mlp.gate.weight", moe.router)
        add(gate_up, moe.gate_up)
        add(down, moe.down)
        part(p + "block_sparse_moe.gate.weight", p + "mlp.gate.weight", moe.router.data)
        # GGUF files stack gate and up apart (engine/models/weights.py `gguf_weight_shapes`).
        part(p + "mlp.experts.gate_proj", gate_up, moe.gate_up.data.narrow(1, 0, inter))
        part(p + "mlp.experts.up_proj", gate_up, moe.gate_up.data.narrow(1, inter, inter))
        for e in range(self.config.num_experts):
            gate = moe.gate_up.data[e].narrow(0, 0, inter)
            up = moe.gate_up.data[e].narrow(0, inter, inter)
            for prefix, names in (
                (f"{p}block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
                (f"{p}mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
            ):
                part(prefix + f"{names[0]}.weight", gate_up, gate)
                part(prefix + f"{names[1]}.weight", gate_up, up)
                part(prefix + f"{names[2]}.weight", down, moe.down.data[e])
