"""server/openai/reasoning.py: the reasoning parsers, whole and streamed (pure, no server)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.scheduler import StructuredOutputs
from pagedserve.server.openai.reasoning import REASONING_PARSERS, ReasoningPlan, reasoning_plan

STARTS = (None, "reasoning", "content")
# Pieces that make tags, near-tags and their parts likely.
FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "think", ">", "/", " ", "\n", "a", "é", "x1"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)


def reference(parser: str, start: str | None, text: str) -> tuple[str | None, str | None]:
    """The split as the module docstring states it, written with str.partition."""
    if start == "content":
        return None, text or None
    stripped = text.lstrip()
    opened = stripped.startswith("<think>")
    if opened:
        text = stripped[len("<think>") :]
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        return reasoning or None, content or None
    if opened or parser == "deepseek_r1" or start == "reasoning":
        return text or None, None
    return None, text or None


def streamed(
    plan: ReasoningPlan, pieces: list[str], expected: tuple[str | None, str | None]
) -> tuple[str | None, str | None]:
    stream = plan.stream()
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
        # What was given out stays given: never a piece of a tag, never the other part's text.
        assert (expected[0] or "").startswith(reasoning)
        assert (expected[1] or "").startswith(content)
    r, c = stream.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize(
    "parser, start, text, expected",
    [
        ("qwen3", None, "<think>\nhmm\n</think>\n\nHello", ("\nhmm\n", "\n\nHello")),
        ("qwen3", None, "Hello, no thinking", (None, "Hello, no thinking")),
        ("qwen3", None, "reasoned</think>answer", ("reasoned", "answer")),
        ("qwen3", None, "<think>cut short", ("cut short", None)),
        ("qwen3", "content", "<think>a</think>b", (None, "<think>a</think>b")),
        ("qwen3", "reasoning", "still thinking", ("still thinking", None)),
        ("deepseek_r1", None, "thinking</think>answer", ("thinking", "answer")),
        ("deepseek_r1", None, "  <think>t</think>", ("t", None)),
        ("deepseek_r1", None, "never closed", ("never closed", None)),
        ("deepseek_r1", None, "</think>only content", (None, "only content")),
        ("deepseek_r1", None, "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_whole_answers_split_as_vllm_does(parser, start, text, expected):
    assert ReasoningPlan(parser, start).parse(text) == expected
    assert reference(parser, start, text) == expected


def test_the_prompt_says_where_the_answer_starts():
    assert reasoning_plan("qwen3", "<|im_start|>assistant\n").start is None
    assert reasoning_plan("qwen3", "assistant\n<think>\n\n</think>\n\n").start == "content"
    assert reasoning_plan("deepseek_r1", "<｜Assistant｜><think>\n").start == "reasoning"
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        reasoning_plan("granite", "")


def test_constraints_apply_after_the_reasoning_unless_they_write_it():
    schema = StructuredOutputs(json={"type": "object"})
    after = StructuredOutputs(json={"type": "object"}, reasoning_end="</think>")
    assert ReasoningPlan("qwen3").constrain(schema) == after
    assert ReasoningPlan("deepseek_r1", "reasoning").constrain(schema) == after
    assert ReasoningPlan("qwen3", "content").constrain(schema) == schema  # the prompt ended it
    whole = StructuredOutputs(regex="<think>[a-z]+</think>[0-9]+")
    assert ReasoningPlan("qwen3").constrain(whole) == whole
    assert ReasoningPlan("qwen3").constrain(None) is None


def test_a_stream_holds_back_only_what_may_be_a_tag():
    stream = ReasoningPlan("deepseek_r1").stream()
    assert stream.feed("<th") == ("", "")  # maybe <think>
    assert stream.feed("ink>I think</") == ("I think", "")  # </ may start </think>
    assert stream.feed("b> is bold</thi") == ("</b> is bold", "")
    assert stream.feed("nk>\nAnswer") == ("", "\nAnswer")
    assert stream.feed(" more") == ("", " more")
    assert stream.finish() == ("", "")
    # qwen3 text without <think> is held until a </think> or the end decides it.
    stream = ReasoningPlan("qwen3").stream()
    assert stream.feed("Hi") == ("", "")
    assert stream.feed(" there") == ("", "")
    assert stream.finish() == ("", "Hi there")


@settings(max_examples=400, deadline=None)
@given(
    parser=st.sampled_from(REASONING_PARSERS),
    start=st.sampled_from(STARTS),
    text=texts,
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_any_chunking_streams_the_whole_answers_split(parser, start, text, cuts):
    plan = ReasoningPlan(parser, start)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = reference(parser, start, text)
    assert plan.parse(text) == expected
    assert streamed(plan, pieces, expected) == expected
    assert streamed(plan, list(text), expected) == expected  # one character at a time


def test_the_flag_reaches_the_server_config():
    from pagedserve.server.cli import build_parser
    from pagedserve.server.server_config import ServerConfig

    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert ServerConfig.from_cli_args(args).reasoning_parser == "deepseek_r1"
    assert ServerConfig().reasoning_parser is None
    with pytest.raises(
        ValueError, match=r"reasoning_parser must be one of \['qwen3', 'deepseek_r1'\]"
    ):
        ServerConfig(reasoning_parser="granite")
