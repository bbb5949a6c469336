"""Structured outputs after a reasoning (`StructuredOutputs.reasoning_end`): the matcher lets
every token through until the output has written `</think>`, then constrains what follows, in
sampled tokens, drafts and rewinds (engine/structured_output.py, with SmolLM2's vocabulary, in
which `</think>` is several tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.engine.structured_output import (
    ALL_ALLOWED,
    StructuredOutputManager,
    bitmask_words,
)
from pagedserve.scheduler import StructuredOutputs

SPEC = StructuredOutputs(regex="[0-9,]{2}", reasoning_end="</think>")


@pytest.fixture
def manager(real_llm):
    core = real_llm.engine.core
    return StructuredOutputManager(
        real_llm.get_tokenizer(), core.model_config.vocab_size, core.eos_token_ids
    )


def _start(manager: StructuredOutputManager, *request_ids: str):
    manager.compile(SPEC, list(request_ids))
    ((ids, compiled),) = manager.compiled(wait=True)
    for request_id in ids:
        manager.start(request_id, compiled)
    return compiled


def _masks(manager, request_id, drafts=()) -> np.ndarray:
    out = np.zeros((1 + len(drafts), bitmask_words(manager.vocab_size)), dtype=np.int32)
    manager.fill(request_id, list(drafts), out)
    return out


def _reference(compiled, vocab_size: int, accepted: list[int]) -> np.ndarray:
    """The mask a fresh matcher of the bare grammar gives after `accepted`."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token_id in accepted:
        assert matcher.accept_token(token_id)
    out = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def _allowed(mask: np.ndarray, token_id: int) -> bool:
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def test_the_grammar_starts_after_the_reasoning_ends(manager, real_llm):
    tok = real_llm.get_tokenizer()
    compiled = _start(manager, "a")
    thinking = tok.encode("Let me count: 4 and </", add_special_tokens=False)
    closing = tok.encode("think>", add_special_tokens=False)
    digits, letter = tok.encode("42", add_special_tokens=False), tok.encode("x")[0]
    assert len(digits) == 2  # one token per digit in SmolLM2's vocabulary

    # Reasoning, "</" included: anything goes (the letter the grammar refuses, EOS).
    assert (_masks(manager, "a") == ALL_ALLOWED).all()
    assert manager.accept("a", thinking) and manager.is_reasoning("a")
    assert (_masks(manager, "a") == ALL_ALLOWED).all()
    # "think>" completes "</think>": the regex from here on, as a fresh matcher has it.
    assert manager.accept("a", closing) and not manager.is_reasoning("a")
    mask = _masks(manager, "a")[0]
    assert (mask == _reference(compiled, manager.vocab_size, [])).all()
    assert _allowed(mask, digits[0]) and not _allowed(mask, letter)
    assert manager.accept("a", digits[:1])
    assert not manager.accept("a", [letter])  # refused after the reasoning

    # A rewind replays the output: still past the reasoning, one digit in.
    assert manager.restart("a", thinking + closing + digits[:1])
    assert not manager.is_reasoning("a")
    expected = _reference(compiled, manager.vocab_size, digits[:1])
    assert (_masks(manager, "a")[0] == expected).all()
    assert manager.restart("a", thinking)
    assert manager.is_reasoning("a")


def test_drafts_that_end_the_reasoning_are_followed_by_grammar_rows(manager, real_llm):
    tok = real_llm.get_tokenizer()
    compiled = _start(manager, "b")
    end = tok.encode("ok</think>", add_special_tokens=False)
    digit = tok.encode("4", add_special_tokens=False)
    masks = _masks(manager, "b", end + digit)
    # Rows up to the draft that completes "</think>" are free; then the grammar's, and the
    # one after the draft digit is what the grammar allows after that digit.
    assert (masks[: len(end)] == ALL_ALLOWED).all()
    assert (masks[len(end)] == _reference(compiled, manager.vocab_size, [])).all()
    assert (masks[len(end) + 1] == _reference(compiled, manager.vocab_size, digit)).all()
    # Filling rolled the drafts back: the sample is still reasoning.
    assert manager.is_reasoning("b")


def test_text_after_the_end_within_its_token_goes_to_the_grammar(manager, real_llm):
    import xgrammar as xgr

    tok = real_llm.get_tokenizer()
    compiled = _start(manager, "c", "d")
    opening = tok.encode("</think", add_special_tokens=False)
    comma, quote = tok.convert_tokens_to_ids([">,", '>"'])  # ">" with more text in one token
    assert manager.accept("c", opening + [comma]) and not manager.is_reasoning("c")
    reference = xgr.GrammarMatcher(compiled)
    assert reference.accept_string(",")
    expected = np.zeros((1, bitmask_words(manager.vocab_size)), dtype=np.int32)
    reference.fill_next_token_bitmask(expected, 0)
    assert (_masks(manager, "c") == expected).all()  # one of the two characters written
    assert not manager.accept("d", opening + [quote])  # the grammar refuses '"'
    manager.retain(set())
    assert not manager.matchers and not manager.is_reasoning("c")
