"""What a prompt becomes once the engine has accepted it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.engine.structured_output import check as check_structured_outputs
from pagedserve.scheduler import SamplingParams


@dataclass(frozen=True)
class Prompt:
    """A prompt that passed `InputProcessor.process_prompt`: its token ids (non-empty, inside the
    vocabulary, shorter than max_model_len) and its text when it came as text.

    Holding a Prompt is the proof that the checks ran: `add_request` and the layers under it do not
    repeat them. Build one through `process_prompt`, not by hand."""

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class NewRequest:
    """A checked request on its way to a core, whichever client carries it: its id, prompt,
    sampling parameters and arrival time (seconds since the epoch)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float


class InputProcessor:
    """Where a prompt is checked, once, before it is queued: in the caller's process, whether the
    engine core runs there or in its own. Safe from any thread: it reads only the tokenizer and
    two numbers."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def process_prompt(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """Tokenize text, then refuse (ValueError) an empty prompt, ids outside the vocabulary,
        and a prompt that leaves no room for one output token. A Prompt is returned as it is."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            # "" is an empty prompt, not the bos token the tokenizer would add to it.
            text, token_ids = prompt, self.tokenize(prompt) if prompt else []
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter to leave room for one output token"
            )
        vocab = self.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return Prompt(token_ids, text)

    def process_inputs(
        self, prompt: str | Sequence[int] | Prompt, params: SamplingParams
    ) -> Prompt:
        """`process_prompt`, the params' type (their values were checked when they were built)
        and their structured outputs' grammar (`structured_output.check`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        return self.process_prompt(prompt)
