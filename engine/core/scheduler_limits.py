"""The scheduler's limits (`SchedulerConfig`), resolved from the option groups it reads and from
what the worker found: the KV-cache plan, the host pool, the model's context."""

from __future__ import annotations

from pagedserve.engine.config_groups import (
    CacheOptions,
    LoRAOptions,
    SchedulerOptions,
    SpeculativeOptions,
)
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.worker.kv_cache import KVCachePlan
from pagedserve.scheduler import SchedulerConfig


def scheduler_config(
    scheduler: SchedulerOptions,
    cache: CacheOptions,
    speculative: SpeculativeOptions,
    lora: LoRAOptions,
    plan: KVCachePlan,
    *,
    num_host_blocks: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    model_config: ModelConfig,
    embeds: bool,
) -> SchedulerConfig:
    """`embeds`: an embedding model (a prompt runs whole in one step; no prefix cache, since a
    pooled vector needs every token's hidden state)."""
    return SchedulerConfig(
        # The step's budget and the longest request, as the engine core resolved them.
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_blocks=plan.num_blocks,
        block_size=cache.block_size,
        max_num_seqs=scheduler.max_num_seqs,
        # Off for an encoder-decoder too: its KV depends on the audio, not only the tokens.
        enable_prefix_caching=cache.enable_prefix_caching
        and not plan.encoder_blocks
        and not embeds,
        num_speculative_tokens=speculative.speculative_ngram,
        ngram_min=speculative.speculative_ngram_min,
        ngram_max=speculative.speculative_ngram_max,
        kv_group_windows=plan.windows,
        num_host_blocks=num_host_blocks,
        max_prefill_tokens_while_decoding=scheduler.max_prefill_tokens_while_decoding or 0,
        encoder_blocks=plan.encoder_blocks,
        encoder_tokens=(
            model_config.whisper.max_source_positions if model_config.is_encoder_decoder else 0
        ),
        prefill_only=embeds,
        max_loras=lora.max_loras if lora.enable_lora else 0,
    )
