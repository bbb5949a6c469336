"""Whisper (`WhisperForConditionalGeneration` folders): its encoder, the per-layer cross-attention
keys and values computed once from the encoder's output, and the decoder, with transformers'
parameter names (its configuration: engine/models/whisper_config.py).

This is the model's arithmetic, checked against transformers (tests/engine/test_whisper.py), and
its paged form, which the engine's model runner drives as it drives a decoder-only model: at a
request's admission `encode_into_cache` encodes its audio and writes each decoder layer's
cross-attention K/V into the request's encoder blocks (allocated once by the scheduler, from the
same block pool and the same per-layer tensors as the self-attention blocks); then each step's
`forward` writes the decoder's self-attention K/V into paged blocks and reads both back with the
backends' kernels (`cross_metadata` lets the causal kernels read all encoder positions).
`decode` attends over whole sequences held contiguously and `greedy` is the plain argmax loop
over it: the reference the paged path equals.

Whisper in brief: log-mel features [mel bins, 2 x positions] -> two convolutions (the second with
stride 2) with GELU -> + learned positions -> pre-LayerNorm transformer layers (bidirectional) ->
LayerNorm: the encoder states [positions, d_model]. The decoder: token embeddings + learned
positions -> layers of causal self-attention, cross-attention over the encoder states and a GELU
MLP, each pre-LayerNorm with a residual -> LayerNorm -> logits through the tied embedding. k_proj
has no bias in either attention; q/v/out projections do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.engine.models import cpu_linear
from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.weights import iter_safetensors_weights
from pagedserve.engine.models.whisper_config import WhisperConfig
from pagedserve.engine.models.whisper_features import log_mel
from pagedserve.kernels.backend import KernelBackend

if TYPE_CHECKING:
    from pagedserve.engine.models.model_source import ModelSource

logger = logging.getLogger("pagedserve")


class _Linear(nn.Linear):
    """nn.Linear through engine/models/cpu_linear.py: its oneDNN-packed weight once
    `WhisperModel.pack_weights` attached one (on CPU), else F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias)


def _linear(out_features: int, in_features: int, bias: bool = True) -> nn.Linear:
    return _Linear(in_features, out_features, bias=bias)


class _Attention(nn.Module):
    """q/k/v/out projections of a Whisper attention (k without bias)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = _linear(d_model, d_model)
        self.k_proj = _linear(d_model, d_model, bias=False)
        self.v_proj = _linear(d_model, d_model)
        self.out_proj = _linear(d_model, d_model)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, heads, T, head_dim]."""
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def self_attend(self, h: torch.Tensor, causal: bool) -> torch.Tensor:
        """Self-attention of normalised states h [B, T, d], through out_proj."""
        return self.attend(self.split(self.q_proj(h)), self.split(self.k_proj(h)),
                           self.split(self.v_proj(h)), causal)  # fmt: skip

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        """q, k, v [B, heads, T, head_dim] -> [B, T, d] through out_proj."""
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        b, h, t, hd = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, h * hd))


class _EncoderLayer(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = _linear(c.encoder_ffn_dim, c.d_model)
        self.fc2 = _linear(c.d_model, c.encoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.self_attend(self.self_attn_layer_norm(x), causal=False)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class _DecoderLayer(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c.d_model, c.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.encoder_attn = _Attention(c.d_model, c.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = _linear(c.decoder_ffn_dim, c.d_model)
        self.fc2 = _linear(c.d_model, c.decoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(
        self, x: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn.self_attend(self.self_attn_layer_norm(x), causal=True)
        c = self.encoder_attn
        x = x + c.attend(
            c.split(c.q_proj(self.encoder_attn_layer_norm(x))), cross_k, cross_v, False
        )
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class _Encoder(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.d_model)
        self.layers = nn.ModuleList(_EncoderLayer(c) for _ in range(c.encoder_layers))
        self.layer_norm = nn.LayerNorm(c.d_model)


class _Decoder(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_target_positions, c.d_model)
        self.layers = nn.ModuleList(_DecoderLayer(c) for _ in range(c.decoder_layers))
        self.layer_norm = nn.LayerNorm(c.d_model)


class _Model(nn.Module):
    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.encoder = _Encoder(c)
        self.decoder = _Decoder(c)


class WhisperModel(nn.Module):
    """Whisper's encoder and decoder, with transformers' parameter names (`model.encoder.*`,
    `model.decoder.*`; the logits reuse `model.decoder.embed_tokens`, which `proj_out` ties)."""

    is_encoder_decoder = True

    def __init__(self, config: WhisperConfig, attention_ops: KernelBackend = kernels.reference):
        super().__init__()
        self.config = config
        self.ops = attention_ops  # the kernels' backend of the paged path
        self.model = _Model(config)

    # ---- encoder -------------------------------------------------------------------------------

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [B, mel bins, 2 x positions] -> encoder states [B, positions, d]."""
        c = self.config
        if features.dim() != 3 or features.shape[1:] != (c.num_mel_bins, c.num_frames):
            raise ValueError(
                f"Whisper features must be [batch, {c.num_mel_bins}, {c.num_frames}] (30 s, "
                f"padded), got {tuple(features.shape)}"
            )
        enc = self.model.encoder
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(features)))).transpose(1, 2)
        x = x + enc.embed_positions.weight
        for layer in enc.layers:
            x = layer(x)
        return enc.layer_norm(x)

    def cross_kv(self, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention keys and values [B, heads, positions, head_dim]:
        computed once per request from the encoder states, then only read."""
        out = []
        for layer in self.model.decoder.layers:
            a = layer.encoder_attn
            out.append((a.split(a.k_proj(encoded)), a.split(a.v_proj(encoded))))
        return out

    # ---- decoder -------------------------------------------------------------------------------

    def decode(
        self, tokens: torch.Tensor, cross: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (float32) of whole token sequences [B, T] (positions 0..T-1)."""
        c, dec = self.config, self.model.decoder
        if tokens.shape[1] > c.max_target_positions:
            raise ValueError(
                f"Whisper decodes at most {c.max_target_positions} tokens, got {tokens.shape[1]}"
            )
        x = dec.embed_tokens(tokens)
        if c.scale_embedding:
            x = x * math.sqrt(c.d_model)
        x = x + dec.embed_positions.weight[: tokens.shape[1]]
        for layer, (k, v) in zip(dec.layers, cross, strict=True):
            x = layer(x, k, v)
        return cpu_linear.linear(dec.layer_norm(x), dec.embed_tokens.weight).float()

    # ---- paged: the engine's model runner drives these ------------------------------------

    def encode_into_cache(
        self,
        audio: list[bytes],
        block_ids: list[tuple[int, ...]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
    ) -> None:
        """Encode requests' audio (16 kHz float32 samples, at most `config.window_samples` each)
        and write each decoder layer's cross-attention K/V into their blocks, request b's encoder
        position p at block_ids[b][p // block_size], offset p % block_size: once per request,
        at its admission; its decoding steps only read them."""
        c = self.config
        samples = [np.frombuffer(a, dtype=np.float32) for a in audio]
        weight = self.model.decoder.embed_tokens.weight
        features = log_mel(samples, c.num_mel_bins, c.num_frames).to(weight.device, weight.dtype)
        positions = torch.arange(c.max_source_positions)
        tables = torch.tensor(block_ids, dtype=torch.int64)
        slots = tables[:, positions // block_size] * block_size + positions % block_size
        slots = slots.reshape(-1).to(weight.device)
        for (k, v), (k_cache, v_cache) in zip(
            self.cross_kv(self.encode(features)), kv_caches, strict=True
        ):
            b, h, p, d = k.shape
            self.ops.reshape_and_cache(
                k.transpose(1, 2).reshape(b * p, h, d),
                v.transpose(1, 2).reshape(b * p, h, d),
                k_cache,
                v_cache,
                slots,
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states [num_tokens, d] of a step's decoder tokens (flattened over its
        requests, at `positions`): self-attention K/V written to `meta`'s slots and read back
        through its block tables, the encoder's K/V read from the same caches through
        `meta.cross` (`cross_metadata`), with the backend `self.ops`."""
        c, dec, ops = self.config, self.model.decoder, self.ops
        n, heads, hd = input_ids.shape[0], c.decoder_attention_heads, c.head_dim
        scale = 1.0 / math.sqrt(hd)
        cross = meta.cross
        x = dec.embed_tokens(input_ids)
        if c.scale_embedding:
            x = x * math.sqrt(c.d_model)
        x = x + dec.embed_positions(positions)
        for layer, (k_cache, v_cache) in zip(dec.layers, kv_caches, strict=True):
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            q = a.q_proj(h).view(n, heads, hd)
            k, v = a.k_proj(h).view(n, heads, hd), a.v_proj(h).view(n, heads, hd)
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping[0])
            out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables[0], meta.seq_lens,
                                      meta.query_start_loc, scale)  # fmt: skip
            x = x + a.out_proj(out.reshape(n, c.d_model))
            a = layer.encoder_attn
            q = a.q_proj(layer.encoder_attn_layer_norm(x)).view(n, heads, hd)
            out = ops.paged_attention(q, k_cache, v_cache, cross.block_tables[0], cross.seq_lens,
                                      cross.query_start_loc, scale)  # fmt: skip
            x = x + a.out_proj(out.reshape(n, c.d_model))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits through the tied embedding."""
        return cpu_linear.linear(hidden, self.model.decoder.embed_tokens.weight).float()

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in; every parameter exactly once (`proj_out.weight`
        is the tied embedding and is skipped), else a ValueError naming what is missing or
        unexpected."""
        params = dict(self.named_parameters())
        filled = set()
        for name, tensor in weights:
            if name == "proj_out.weight":
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in a Whisper model")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(params[name].shape)}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def pack_weights(self) -> bool:
        """Pre-pack every matmul weight (the projections and the tied embedding's logits) for
        oneDNN where that applies (engine/models/cpu_linear.py: bf16 or float32 on CPU), after the
        weights are loaded and the model is on its device and dtype; whether it did."""
        weight = self.model.decoder.embed_tokens.weight
        if not cpu_linear.can_pack(weight.device, weight.dtype):
            return False
        for module in self.modules():
            if isinstance(module, _Linear):
                cpu_linear.pack(module.weight)
        cpu_linear.pack(weight)
        return True


def cross_metadata(tables: np.ndarray, positions: int) -> AttentionMetadata:
    """The cross-attention view of a step whose decoder token i belongs to a request with cross
    blocks `tables[i]` ([num_tokens, blocks] int32, host): each token is its own "sequence" of
    one new token over all `positions` encoder keys. The paged kernels are causal, and the last
    query of a sequence sees every key, so this reads the encoder states unmasked with the same
    kernels, for prompt chunks too. (Host tensors: the runner sends them to the device.)"""
    n = len(tables)
    return AttentionMetadata(
        slot_mapping=torch.full((1, n), -1, dtype=torch.int64),  # (cross K/V is only read)
        block_tables=torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32))[None],
        seq_lens=torch.full((n,), positions, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
    )


def load_whisper_model(
    source: ModelSource,
    load_format: str,
    device: torch.device,
    dtype: torch.dtype,
    attention_ops: KernelBackend,
) -> WhisperModel:
    """The model of a Whisper source on its device and dtype, its matmul weights packed: the
    folder's safetensors, or random weights (the caller seeds them) for a folder without any, a
    config file, a built-in shape or --load-format dummy."""
    config = source.config.whisper
    with device:  # random weights drawn where they run (1.5B of them for whisper-large-v3)
        model = WhisperModel(config, attention_ops).eval()
    folder = source.path if source.kind == "hf_dir" else None
    if load_format == "dummy" or folder is None or not any(folder.glob("*.safetensors")):
        logger.warning("Whisper model %r: random weights (no safetensors, or --load-format "
                       "dummy)", source.name)  # fmt: skip
    elif load_format in ("auto", "safetensors"):
        model.load_weights(iter_safetensors_weights(folder))
    else:
        raise ValueError(f"--load-format {load_format} does not read Whisper folders")
    model.to(device, dtype)
    model.pack_weights()
    return model


@torch.inference_mode()
def greedy(
    model: WhisperModel, features: torch.Tensor, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens after each prompt (its decoder prefix, e.g. [decoder_start]), for a batch of
    audio features, stopping a row at end of text: the reference the paged decoder must equal.
    Whole sequences are re-decoded each step (no cache)."""
    cross = model.cross_kv(model.encode(features))
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        for i, prompt in enumerate(prompts):
            if done[i]:
                continue
            seq = torch.tensor([prompt + outputs[i]])
            row_cross = [(k[i : i + 1], v[i : i + 1]) for k, v in cross]
            token = int(model.decode(seq, row_cross)[0, -1].argmax())
            outputs[i].append(token)
            done[i] = token == model.config.eos_token_id
        if all(done):
            break
    return outputs
