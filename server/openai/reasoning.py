"""Reasoning parsers (`--reasoning-parser`): a reasoning model's `<think>...</think>` part of an
answer, given to the client apart as `reasoning_content` (vLLM's names and field).

- `qwen3`: an answer that starts with `<think>` reasons until `</think>` (all of it when cut
  short); without `<think>`, the text before a `</think>` is reasoning (a template that opened
  `<think>` in the prompt), and text with no `</think>` at all is content.
- `deepseek_r1`: the template opens `<think>` in the prompt, so the answer reasons from its
  start (a leading `<think>` is dropped) until `</think>`; without one it is all reasoning.

A request's structured outputs constrain the answer after the reasoning (`constrain`): as in
vLLM, a grammar waits for `</think>`, so a qwen3 answer that never thinks is not constrained.
The prompt decides first (`reasoning_plan`): one that ends with `</think>` (Qwen3's
`enable_thinking=False`) is answered in content only; one that ends with `<think>` starts the
answer in the reasoning. The whole text (`parse`) and the text streamed in any pieces
(`ReasoningStream.feed`, `finish`) split the same way: a piece that may be the start of a tag is
held back until the next one says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pagedserve.scheduler import StructuredOutputs

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Prompt tail tokens read to tell whether the template opened or closed the reasoning.
PROMPT_TAIL_TOKENS = 16

Start = Literal["reasoning", "content"] | None  # what the prompt says the answer starts in


@dataclass(frozen=True)
class ReasoningPlan:
    """How the choices of one request split their text: the parser and the prompt's say."""

    parser: str  # one of REASONING_PARSERS
    start: Start = None

    def constrain(self, spec: StructuredOutputs | None) -> StructuredOutputs | None:
        """`spec` for these answers: it applies after the reasoning (`reasoning_end`), unless
        the prompt has ended the reasoning, or the spec writes `</think>` itself (a regex,
        grammar or choice that shapes the reasoning too applies from the start)."""
        if spec is None or self.start == "content":
            return spec
        if THINK_CLOSE in (spec.regex or "") + (spec.grammar or "") + "".join(spec.choice or ()):
            return spec
        return dataclasses.replace(spec, reasoning_end=THINK_CLOSE)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, each None when empty."""
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None


def reasoning_plan(parser: str, prompt_text: str) -> ReasoningPlan:
    """The plan for a prompt whose text ends with `prompt_text` (its last tokens, decoded)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    tail = prompt_text.rstrip()
    start: Start = None
    if tail.endswith(THINK_CLOSE):
        start = "content"
    elif tail.endswith(THINK_OPEN):
        start = "reasoning"
    return ReasoningPlan(parser, start)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """One choice's text as it streams: `feed(piece)` and then `finish()` return the
    (reasoning, content) text to send, "" for none."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        # "lead": may still open with <think>; "reasoning"; "undecided": qwen3 text without a
        # leading <think>, reasoning only if a </think> comes; "content".
        self._mode = "content" if plan.start == "content" else "lead"
        self._held = ""  # text received but not yet given out

    def feed(self, piece: str) -> tuple[str, str]:
        self._held += piece
        reasoning, content = "", ""
        if self._mode == "lead":
            stripped = self._held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._held, self._mode = stripped[len(THINK_OPEN) :], "reasoning"
            elif THINK_OPEN.startswith(stripped):
                return "", ""  # whitespace, or maybe the start of <think>
            else:
                self._mode = self._after_lead()
        if self._mode in ("reasoning", "undecided"):
            end = self._held.find(THINK_CLOSE)
            if end >= 0:
                reasoning = self._held[:end]
                self._held, self._mode = self._held[end + len(THINK_CLOSE) :], "content"
            elif self._mode == "reasoning":
                keep = _partial_suffix(self._held, THINK_CLOSE)
                cut = len(self._held) - keep
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            else:
                return "", ""  # undecided: wait for </think> or the end
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the choice has ended."""
        held, self._held = self._held, ""
        mode = self._after_lead() if self._mode == "lead" else self._mode
        if mode == "reasoning":
            return held, ""
        return "", held  # content, or undecided text that never closed a reasoning

    def _after_lead(self) -> str:
        if self.plan.parser == "deepseek_r1" or self.plan.start == "reasoning":
            return "reasoning"
        return "undecided"
