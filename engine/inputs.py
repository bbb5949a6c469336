"""What a prompt becomes once the engine has accepted it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """A prompt that passed `LLMEngine.process_prompt`: its token ids (non-empty, inside the
    vocabulary, shorter than max_model_len) and its text when it came as text.

    Holding a Prompt is the proof that the checks ran: `add_request` and the layers under it do not
    repeat them. Build one through `process_prompt`, not by hand."""

    token_ids: list[int]
    text: str | None = None
