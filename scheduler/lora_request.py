"""What names a LoRA adapter from the front end to the worker: the scheduler keeps adapters'
requests apart (their KV differs: the prefix cache keys blocks by adapter, and a step holds at
most `max_loras` adapters), the worker loads the weights."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: the name clients put in `model`, a positive id unique for the server's life
    (never reused, so a block cached under one adapter is never read under another loaded later
    with the same name), and where its weights are (a PEFT folder or a GGUF LoRA file)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}"
            )
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
