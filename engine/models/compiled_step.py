"""The decoder's steps of decodes and short prompts as one compiled call, on CPU.

A decode step of one stream on CPU is some 450 small ops dispatched from Python; on the 2-core dev
VM the gaps between them took as long as the ops and slowed the matmuls themselves, whose weights
went cold in the caches meanwhile (docs/benchmarks-history.md, "The decode step as one call"). For
the models and steps below, `CausalLM.forward` hands all its layers to one C++ call instead
(`kernels/csrc/cpu_decoder.cpp`): the same kernels, in the same order, on the same values, so the
hidden states are the Python path's bit for bit (tests/engine/test_compiled_step.py).

Models: the Llama family's layers (Llama, SmolLM2, Mistral, Qwen2 with its q/k/v bias, Phi-3),
Qwen3's per-head q/k norms and Gemma's (its four norms a layer of 1 + weight, GELU-tanh, soft-capped
scores), with every layer's matmul weights kept as a GGUF file's blocks
(engine/models/quantized_linear.py), the compiled CPU backend, one process (no tensor
parallelism). Mixtures of experts stay on the Python path, as does a model with dense weights.

Steps: the attention kernel takes every sequence (`cpu_ops.kernel_attends`: decodes, speculative
verifies, short prompts) and the step's rows take the blocks' dot products or the AMX tiles
(`quantized_linear.route`); other steps (long prompts), and steps with LoRA adapters attached,
run layer by layer.
"""

from __future__ import annotations

import torch

from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.quantized_linear import BlockWeight, quantized, route
from pagedserve.kernels import cpu_features, cpu_ops

KVCache = tuple[torch.Tensor, torch.Tensor]


def unsupported(model) -> str | None:
    """Why `model` (a CausalLM) cannot run its steps compiled, or None where it can."""
    from pagedserve.engine.models.model import MLP

    config = model.config
    first = model.layers[0].self_attn if len(model.layers) else None
    reasons = {
        "the model has no layers": first is None,
        "the compiled CPU backend is not the model's": first is not None
        and first.ops is not cpu_ops,
        "the CPU kernels did not load": not cpu_ops.available(),
        "tensor parallelism": model.tp is not None,
        f"the {config.hidden_act} activation": config.hidden_act not in _ACTIVATIONS,
        "an fp8 KV cache": first is not None and bool(first.kv_scales),
        "a mixture of experts": any(not isinstance(layer.mlp, MLP) for layer in model.layers),
    }
    found = [reason for reason, applies in reasons.items() if applies]
    if found:
        return ", ".join(found)
    for layer in model.layers:
        weights = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_up_proj, layer.mlp.down_proj)  # fmt: skip
        if any(quantized(w) is None for w in weights):
            return "matmul weights not kept as GGUF blocks"
    return None


_ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}  # -> whether the step takes GELU-tanh


def _parts(weight: BlockWeight) -> tuple[list[torch.Tensor], list[int]]:
    return [p.blocks for p in weight.parts], [p.kernel_type for p in weight.parts]


def _weight(norm) -> torch.Tensor | None:
    return None if norm is None else norm.weight


class CompiledStep:
    """A CausalLM's layers and final norm as one `torch.classes.pagedserve_cpu.DecoderLayers`;
    `takes` says whether a step can run there, calling it runs the step."""

    def __init__(self, model) -> None:
        config = model.config
        first = model.layers[0].self_attn
        self._first = first
        self._layers = torch.classes.pagedserve_cpu.DecoderLayers(
            first.num_heads, first.num_kv_heads, first.head_dim, config.rms_norm_eps,
            first.scale, model.norm.weight, config.is_gemma, first.softcap or 0.0,
            _ACTIVATIONS[config.hidden_act],
        )  # fmt: skip
        # The step's route (`quantized_linear.route`): by interleaved rows' crossovers where
        # every layer's weights are.
        self._interleaved = all(
            quantized(p).interleaved
            for layer in model.layers
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj)
        )  # fmt: skip
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            rotary = model.rotary_of(layer)
            self._layers.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                *_parts(quantized(attn.qkv_proj)), attn.qkv_bias,
                *_parts(quantized(attn.o_proj)), *_parts(quantized(mlp.gate_up_proj)),
                *_parts(quantized(mlp.down_proj)), rotary.cos, rotary.sin,
                attn.sliding_window or 0, attn.kv_group, _weight(attn.q_norm),
                _weight(attn.k_norm), _weight(layer.pre_feedforward_layernorm),
                _weight(layer.post_feedforward_layernorm),
            )  # fmt: skip

    def takes(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Whether this step runs compiled: its rows take the kept weights' block routes, the
        attention kernel takes every sequence (`cpu_ops.kernel_attends`: decodes, short extends
        and short prompts), no LoRA adapter is attached, and the cache holds the activations'
        dtype."""
        if route(x.shape[0], x.dtype, self._interleaved) == "dense":
            return False
        if self._first.qkv_lora is not None:
            return False
        if self._first.calibrate_dtype is not None or kv_caches[0][0].dtype != x.dtype:
            return False
        if x.shape[0] == meta.seq_lens.shape[0]:  # one new token each: a decode step
            return True
        starts, totals = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        return all(
            cpu_ops.kernel_attends(end - start, total, x.dtype, self._first.head_dim)
            for start, end, total in zip(starts[:-1], starts[1:], totals, strict=True)
        )

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final normed hidden states of the step's tokens, `x` their embeddings (overwritten:
        the residual stream)."""
        return self._layers.forward(
            x.contiguous(), positions.contiguous(), [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, route(x.shape[0], x.dtype, self._interleaved) == "amx",
            cpu_features.batch_variant(),
        )  # fmt: skip
