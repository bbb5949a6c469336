"""Structured outputs over HTTP, with the official `openai` client against a real server and
the real SmolLM2: `chat.completions.parse` with a pydantic model, JSON mode, vLLM's
structured_outputs and guided_* fields on both endpoints, streamed and not; malformed
constraints are OpenAI-shaped 400s and the server goes on."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from tests.engine.test_structured_outputs import Person
from tests.server.util import client

MODEL = "smollm2-135m-instruct"


def _async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


async def _gather(calls):
    return await asyncio.gather(*calls)


def test_parse_into_a_pydantic_model_twenty_times_out_of_twenty(server):
    """The official client's `parse` sends the model's JSON schema (response_format
    json_schema, strict) and parses the answer into the model; at temperature 1, 20 concurrent
    requests all parse."""
    c = _async_client(server)
    calls = [
        c.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=Person,
            temperature=1.0,
            seed=i,
            max_tokens=600,
        )
        for i in range(20)
    ]
    results = asyncio.run(_gather(calls))
    for r in results:
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person)
        assert message.parsed == Person.model_validate_json(message.content)


def _chat_texts(server, extra: dict, content: str, n: int = 20, **kwargs) -> list[str]:
    c = _async_client(server)
    calls = [
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            temperature=kwargs.get("temperature", 1.0),
            seed=i,
            max_tokens=150,
            extra_body=extra,
            response_format=kwargs.get("response_format", openai.NOT_GIVEN),
        )
        for i in range(n)
    ]
    results = asyncio.run(_gather(calls))
    assert all(r.choices[0].finish_reason == "stop" for r in results)
    return [r.choices[0].message.content for r in results]


def test_json_mode_regex_and_choice_hold_for_twenty_sampled_requests(server):
    # JSON mode bounds nothing, so it samples a little cooler (see the engine test).
    asked = 'Reply in JSON: an object with the keys "city" and "country" of a European capital.'
    for text in _chat_texts(
        server, {}, asked, temperature=0.7, response_format={"type": "json_object"}
    ):
        assert isinstance(json.loads(text), dict)
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{1,2} (May|June)"
    for text in _chat_texts(server, {"structured_outputs": {"regex": pattern}}, "A date:"):
        assert re.fullmatch(pattern, text)
    choices = ["positive", "negative", "neutral"]
    # vLLM's older field name, still sent by many clients.
    for text in _chat_texts(server, {"guided_choice": choices}, "Sentiment of 'I love it':"):
        assert text in choices


def test_a_constrained_stream_gives_the_non_streamed_text(server):
    c = client(server)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
        temperature=1.0,
        seed=7,
        max_tokens=600,
    )
    whole = c.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in c.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
    ]
    assert len(pieces) > 10 and "".join(pieces) == whole
    Person.model_validate_json(whole)


def test_completions_take_the_same_constraints(server):
    c = client(server)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer"],
    }
    r = c.completions.create(
        model=MODEL,
        prompt=["Two plus two is", "Ten times ten is"],
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=40,
        extra_body={"guided_json": schema, "guided_decoding_backend": "xgrammar"},
    )
    assert len(r.choices) == 4
    for choice in r.choices:
        assert 0 <= json.loads(choice.text)["answer"] <= 100 and choice.finish_reason == "stop"
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    r = c.completions.create(
        model=MODEL,
        prompt="Two plus two:",
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].text)


MSG = [{"role": "user", "content": "hi"}]
BAD = [
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
        "response_format", 'invalid JSON schema for structured outputs: .*"frobnicate"',
        id="bad-schema",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format", 'needs "json_schema": {"name": ..., "schema"', id="no-schema",
    ),
    pytest.param(
        {"response_format": "json"}, "response_format", "must be an object with a", id="not-dict"
    ),
    pytest.param(
        {"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
        "invalid regex for structured outputs: .*parenthesis", id="bad-regex",
    ),
    pytest.param(
        {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
        "exactly one of json, json_object, regex, choice and grammar, got regex, choice",
        id="two-kinds",
    ),
    pytest.param(
        {"structured_outputs": {"xml": "<a/>"}}, "structured_outputs",
        "structured_outputs.xml is not supported", id="unknown-kind",
    ),
    pytest.param(
        {"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex",
        "only one field may constrain the output, got response_format, guided_regex",
        id="two-fields",
    ),
    pytest.param(
        {"guided_choice": []}, "guided_choice", "choice must be a non-empty list", id="no-choice"
    ),
    pytest.param(
        {"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar",
        id="bad-grammar",
    ),
    pytest.param(
        {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
        "'outlines' is not available; this server uses xgrammar", id="backend",
    ),
    pytest.param(
        {"guided_regex": "a", "use_beam_search": True, "n": 2}, "structured_outputs",
        "structured_outputs is not supported with use_beam_search", id="beam-search",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_a_malformed_constraint_is_a_400_naming_its_field(server, fields, param, message):
    with httpx.Client(timeout=30) as http:
        for path, body in (
            ("chat/completions", {"messages": MSG, **fields}),
            ("completions", {"prompt": "hi", **fields}),
        ):
            r = http.post(f"{server.v1}/{path}", json={"model": MODEL, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param)
            assert re.search(message, error["message"]), error["message"]
        # The same connection serves a constrained request afterwards.
        r = http.post(
            f"{server.v1}/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 5, "guided_choice": ["yes"]},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "yes"
