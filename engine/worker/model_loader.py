"""The worker's model, built and loaded from the model options: a decoder (`CausalLM`, its GGUF
matmul weights kept quantized where they can be, and its decode step compiled into one call on
CPU), Whisper or BERT."""

from __future__ import annotations

import logging

import torch

from pagedserve.engine.config_groups import ModelOptions
from pagedserve.engine.models.bert import BertModel, load_bert_model
from pagedserve.engine.models.compiled_step import CompiledStep, unsupported
from pagedserve.engine.models.cpu_linear import can_pack
from pagedserve.engine.models.model import CausalLM
from pagedserve.engine.models.model_source import ModelSource
from pagedserve.engine.models.parallel import TPGroup, TPShard
from pagedserve.engine.models.quantized_linear import describe, keep_quantized
from pagedserve.engine.models.weights import load_weights
from pagedserve.engine.models.whisper import WhisperModel, load_whisper_model
from pagedserve.kernels.backend import KernelBackend

logger = logging.getLogger("pagedserve")


def load_model(
    options: ModelOptions,
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    attention_ops: KernelBackend,
    max_model_len: int,
    *,
    shard: TPShard | None = None,
    tp: TPGroup | None = None,
    log: bool = True,
) -> CausalLM | WhisperModel | BertModel:
    """`shard` and `tp`: this rank's share of a tensor-parallel model; `log`: whether this rank
    says how the weights are kept and the decode step runs."""
    config = source.config
    if config.is_encoder_only:
        torch.manual_seed(options.seed)  # (random weights: the same for a seed)
        return load_bert_model(source, options.load_format, device, dtype)
    if config.is_encoder_decoder:
        torch.manual_seed(options.seed)  # (random weights: the same for a seed)
        return load_whisper_model(source, options.load_format, device, dtype, attention_ops)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(config, max_model_len, attention_ops=attention_ops, shard=shard, tp=tp)
    finally:
        torch.set_default_dtype(previous)
    sharded = shard is not None
    keep = keep_quantized(options.quantization, source.kind, device, dtype, sharded=sharded)
    weights = load_weights(source, options.load_format, keep_quantized=keep)
    if shard is not None:
        weights = shard.slice_weights(weights, config)
    model.load_weights(weights)
    model.use_kv_cache_dtype(kv_cache_dtype)
    kept = model.prepare_matmul_weights(pack_dense=can_pack(device, dtype))
    if kept:
        why_not = "--enforce-eager" if options.enforce_eager else unsupported(model)
        model.compiled_step = CompiledStep(model) if why_not is None else None
        if log:
            logger.info(describe(kept, dtype))
            logger.info(
                "decode steps run %s",
                "as one compiled call (kernels/csrc/cpu_decoder.cpp)"
                if why_not is None
                else f"layer by layer ({why_not})",
            )
    return model.eval()
