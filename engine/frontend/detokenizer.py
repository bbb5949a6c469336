"""Incremental detokenization and stop-string matching for streaming output.

Decoding the whole output after every token is O(n) per token. Instead we decode a small window
and diff, as vLLM and mini-sglang do:

    ids:   ... prompt tail ... | emitted ... |  held  | new
                               ^prefix_offset ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]     (emitted unless it ends in U+FFFD)

Decoding from `prefix_offset` rather than `read_offset` gives the new tokens their left context
(SentencePiece leading spaces, bytes of a character split across tokens). When `new_text` ends in
U+FFFD the last token(s) hold an incomplete UTF-8 character: nothing is emitted and the offsets
stay, so the next token is decoded together with the held ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output token (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, O(1) decode work per token.

    The concatenation of all deltas (plus `flush()`) equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers
    (GPT-2 style: SmolLM2, Llama 3, Qwen2). For SentencePiece tokenizers the first delta keeps
    the leading space that decoding the output alone would strip, since the prompt is its context.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend_decode = _backend_decode(tokenizer)
        # Only the prompt's tail is ever decoded; ids before prefix_offset are never read again.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces: list[str] = []
        self._num_output_tokens = 0

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back bytes of an incomplete character excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return only the text they complete (may be "")."""
        delta = []
        for token_id in new_token_ids:
            self._ids.append(int(token_id))
            self._num_output_tokens += 1
            delta.append(self._step(final=False))
        text = "".join(delta)
        if text:
            self._pieces.append(text)
        return text

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a request): an incomplete character at the
        very end of the output decodes to U+FFFD, as `tokenizer.decode` would give it."""
        text = self._step(final=True)
        if text:
            self._pieces.append(text)
        return text

    def _step(self, final: bool) -> str:
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete UTF-8 character: wait for its remaining bytes
        if len(new_text) <= len(self._prefix_text):
            # Nothing visible (e.g. a skipped special token). Moving read_offset keeps the
            # window from growing while prefix_text stays the same string.
            self._read_offset = len(self._ids)
            self._prefix_text = new_text
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(self._ids[start:end], self._skip_special_tokens)
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's own `decode` when `tokenizer.decode` is exactly that call (a fast
    tokenizer whose class keeps transformers' decode and that cleans up no spaces), else None.

    Two decodes per output token go through it, so skipping transformers' Python wrapper around
    the same call takes per-token overhead off every step."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return tokenizer.backend_tokenizer.decode
    return None


# ---------------------------------------------------------------------- stop strings


def find_stop(text: str, stop_strings: Sequence[str], checked_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that the characters from `checked_from` on complete:
    `(start index, stop string)`, or None.

    Invariant the caller keeps: `text[:checked_from]` held no stop string (it was checked when
    it was new), so a match must end at or after `checked_from` and only `text[checked_from -
    len(stop) + 1:]` is searched: O(new text + stop length) per step, not O(text). Ties at the
    same start go to the longest stop string.
    """
    best: tuple[int, int, str] | None = None  # (start, -len(stop), stop)
    for stop in stop_strings:
        if not stop:
            continue
        index = text.find(stop, max(0, checked_from - len(stop) + 1))
        if index >= 0 and (best is None or (index, -len(stop)) < best[:2]):
            best = (index, -len(stop), stop)
    return None if best is None else (best[0], best[2])


def stop_holdback(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string.

    A streaming response holds these back until the next tokens show whether a stop string
    follows (then they are cut) or not (then they are sent). 0 when no stop string can start
    within the tail.
    """
    holdback = 0
    for stop in stop_strings:
        for k in range(min(len(stop) - 1, len(text)), holdback, -1):
            if text.endswith(stop[:k]):
                holdback = k
                break
    return holdback
