"""Scheduler limits."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.kv_groups import blocks_per_request


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes and limits of the continuous-batching scheduler.

    The engine builds it from an `EngineConfig` (whose fields hold the defaults and the checks a
    user sees) and a KV-cache plan; here the invariants the scheduler relies on are asserted.

    `max_num_batched_tokens` may be smaller than `max_model_len`: long prompts are then
    prefilled in chunks over several steps. The pool must hold one request of
    `max_model_len` tokens on its own (in every KV-cache group: scheduler/kv_groups.py),
    otherwise a long request could preempt everyone, itself included, and never finish.
    """

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    # Speculative decoding by prompt lookup: up to this many draft tokens per decode step
    # (0: off), from n-grams of ngram_min..ngram_max tokens (scheduler/ngram.py).
    num_speculative_tokens: int = 0
    ngram_min: int = 2
    ngram_max: int = 4
    # One entry per KV-cache group: its sliding window, None for full attention
    # (scheduler/kv_groups.py).
    kv_group_windows: tuple[int | None, ...] = (None,)
    # Swap preemption: blocks of the host pool that preempted requests' KV moves to (and back
    # from when they resume); 0: preemption always recomputes.
    num_host_blocks: int = 0
    # In a step where some request decodes, prompt tokens (new prompts and prefill chunks) take at
    # most the prompts' per-request share of the budget, or this many if more, so a long prompt
    # does not stall the streams (step_plan.prefill_cap); 0: no cap beyond the budget. A step
    # without decodes (a burst of arrivals) takes the whole budget.
    max_prefill_tokens_while_decoding: int = 0
    # Encoder-decoder models (Whisper): the blocks of cross-attention KV a request with an
    # encoder input holds from admission to its end, and the step's token budget its encoder
    # pass counts for (every step admits at least one).
    encoder_blocks: int = 0
    encoder_tokens: int = 0
    # Embedding models: a request's whole prompt runs in one step, never in chunks (an encoder
    # attends both ways; a pooled vector needs every token's hidden state in that step).
    prefill_only: bool = False
    # LoRA: the most adapters the running requests may use at once (the worker's device slots);
    # a waiting request of another adapter waits until one of them has no running request. 0:
    # the engine serves no adapters.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            assert type(value) is int and value >= 1, f"{name} must be an int >= 1, got {value!r}"
        assert type(self.max_model_len) is int and self.max_model_len >= 1, self.max_model_len
        assert isinstance(self.enable_prefix_caching, bool), self.enable_prefix_caching
        assert type(self.num_host_blocks) is int and self.num_host_blocks >= 0, self.num_host_blocks
        cap = self.max_prefill_tokens_while_decoding
        assert type(cap) is int and cap >= 0, cap
        assert self.num_speculative_tokens >= 0, self.num_speculative_tokens
        assert 1 <= self.ngram_min <= self.ngram_max, (self.ngram_min, self.ngram_max)
        assert self.encoder_blocks >= 0 and self.encoder_tokens >= 0
        # Prefix hashes cover the decoder's tokens only: equal prompts over different audio
        # would share KV that differs.
        assert not (self.encoder_blocks and self.enable_prefix_caching), (
            "an encoder-decoder model cannot use the prefix cache"
        )
        assert not self.prefill_only or self.max_num_batched_tokens >= self.max_model_len, (
            "prefill_only needs a step budget that holds a whole max_model_len prompt"
        )
        need = self.encoder_blocks + blocks_per_request(
            self.kv_group_windows, self.max_model_len, self.block_size, self.max_num_batched_tokens
        )
        assert self.num_blocks >= need, (
            f"the KV cache has {self.num_blocks} blocks of {self.block_size} tokens, but one "
            f"request of max_model_len={self.max_model_len} tokens needs {need}"
        )
