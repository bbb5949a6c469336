"""Scheduler limits, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes and limits of the continuous-batching scheduler.

    `max_num_batched_tokens` may be smaller than `max_model_len`: long prompts are then
    prefilled in chunks over several steps. The pool must hold one request of
    `max_model_len` tokens on its own (num_blocks * block_size >= max_model_len), otherwise
    a long request could preempt everyone, itself included, and never finish.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "enable_prefix_caching":
                if not isinstance(value, bool):
                    raise ValueError(f"enable_prefix_caching must be a bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be an int >= 1, got {value!r}")
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks x "
                f"{self.block_size}) but max_model_len is {self.max_model_len}: lower "
                "max_model_len or give the KV cache more memory"
            )
