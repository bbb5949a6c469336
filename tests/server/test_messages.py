"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client against the real server and SmolLM2: answers equal the chat endpoint's for
the same conversation (greedy), stop sequences and max_tokens give Anthropic's stop reasons,
streams parse into the same message, a forced tool call goes round trip, token counts equal the
chat prompt's, errors take Anthropic's shape and map to the client's exception types, x-api-key
opens a keyed server, and no KV block is held afterwards."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest

from tests.server.conftest import MAX_REQUEST_BODY_BYTES
from tests.server.util import client, full_queue, metric, token_count

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a terse geography assistant."
ASK = "What is the capital of France?"
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
# This SDK has no temperature argument any more: it goes in the body as an extra field.
GREEDY = {"model": MODEL, "max_tokens": 12, "extra_body": {"temperature": 0}}
CHAT_GREEDY = {"model": MODEL, "max_tokens": 12, "temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _anthropic(server, **kwargs) -> anthropic.Anthropic:
    # The SDK appends /v1/messages to its base URL.
    kwargs.setdefault("api_key", server.api_key or "unused")
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=120, **kwargs)


def _chat(server, messages, **kwargs):
    return client(server).chat.completions.create(messages=messages, **kwargs).choices[0]


@pytest.fixture(scope="module")
def greedy(server) -> anthropic.types.Message:
    """The greedy answer to SYSTEM + ASK through /v1/messages."""
    return _anthropic(server).messages.create(
        **GREEDY, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )


def test_create_equals_the_chat_endpoints_greedy_answer(server, greedy):
    chat = client(server).chat.completions.create(messages=CHAT_MESSAGES, **CHAT_GREEDY)
    (choice,) = chat.choices
    assert greedy.type == "message" and greedy.role == "assistant"
    assert greedy.id.startswith("msg_") and greedy.model == MODEL
    assert [b.type for b in greedy.content] == ["text"]
    assert greedy.content[0].text == choice.message.content and greedy.content[0].text
    expected = {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
    assert (greedy.stop_reason, greedy.stop_sequence) == (expected, None)
    assert greedy.usage.input_tokens == chat.usage.prompt_tokens
    assert greedy.usage.output_tokens == chat.usage.completion_tokens


def test_stop_sequences_and_max_tokens_give_anthropics_stop_reasons(server, greedy):
    text = greedy.content[0].text
    sequence = " " + text.split()[2]  # the answer's third word
    c = _anthropic(server)
    stopped = c.messages.create(
        **GREEDY, system=SYSTEM, messages=[{"role": "user", "content": ASK}],
        stop_sequences=["never-in-the-answer", sequence],
    )  # fmt: skip
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert stopped.content[0].text == text[: text.index(sequence)]
    short = c.messages.create(
        **{**GREEDY, "max_tokens": 2}, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )
    assert (short.stop_reason, short.stop_sequence) == ("max_tokens", None)
    assert short.usage.output_tokens == 2
    assert text.startswith(short.content[0].text)


def test_output_config_format_constrains_the_answer(server):
    # The tool test's schema: the server compiles its grammar once for both.
    schema = WEATHER["input_schema"]
    message = _anthropic(server).messages.create(
        **{**GREEDY, "max_tokens": 30}, messages=WEATHER_ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert message.stop_reason == "end_turn"
    answer = json.loads(message.content[0].text)
    assert set(answer) == {"city"} and 0 < len(answer["city"]) <= 24


def test_a_stream_parses_into_the_same_message(server, greedy):
    c = _anthropic(server)
    request = {**GREEDY, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]}
    with c.messages.stream(**request) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == greedy.content[0].text
    assert [(b.type, b.text) for b in final.content] == [("text", greedy.content[0].text)]
    assert (final.stop_reason, final.stop_sequence) == (greedy.stop_reason, None)
    assert final.usage.input_tokens == greedy.usage.input_tokens
    assert final.usage.output_tokens == greedy.usage.output_tokens
    # The raw events, in Anthropic's order: one text block.
    events = [e.type for e in c.messages.create(**request, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def _as_blocks(message: anthropic.types.Message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def test_a_forced_tool_call_goes_round_trip(server):
    c = _anthropic(server)
    request = {
        **GREEDY, "max_tokens": 40, "tools": [WEATHER], "messages": WEATHER_ASK,
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }  # fmt: skip
    called = c.messages.create(**request)
    assert called.stop_reason == "tool_use"
    (call,) = called.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert set(call.input) == {"city"} and 0 < len(call.input["city"]) <= 24
    # Streamed, the same call arrives as input_json_delta pieces.
    with c.messages.stream(**request) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        streamed = stream.get_final_message()
    assert kinds == {"input_json_delta"} and streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content] == [("get_weather", call.input)]

    # The tool's result continues the conversation, as the same chat conversation does.
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
    follow = c.messages.create(
        **{**GREEDY, "max_tokens": 8}, tools=[WEATHER], messages=[
            *WEATHER_ASK,
            {"role": "assistant", "content": _as_blocks(called)},
            {"role": "user", "content": [result]},
        ],
    )  # fmt: skip
    function = {"name": "get_weather", "arguments": json.dumps(call.input)}
    chat = _chat(
        server,
        [
            *WEATHER_ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
        ],
        tools=[
            {"type": "function", "function": {**function, "parameters": WEATHER["input_schema"]}}
        ],
        **{**CHAT_GREEDY, "max_tokens": 8},
    )
    expected = [{"type": "text", "text": chat.message.content}] if chat.message.content else []
    expected += [
        {"type": "tool_use", "name": t.function.name, "input": json.loads(t.function.arguments)}
        for t in chat.message.tool_calls or ()
    ]
    assert [{k: v for k, v in b.items() if k != "id"} for b in _as_blocks(follow)] == expected
    assert expected


def test_count_tokens_is_the_chat_prompts_length(server):
    c = _anthropic(server)
    count = c.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    ).input_tokens
    assert count == token_count(server, messages=CHAT_MESSAGES) > 10
    as_blocks = c.messages.count_tokens(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
    )
    assert as_blocks.input_tokens == count
    # With tools: the prompt create() runs, tools shown in it.
    with_tools = c.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=WEATHER_ASK)
    ran = c.messages.create(**{**GREEDY, "max_tokens": 1}, tools=[WEATHER], messages=WEATHER_ASK)
    assert with_tools.input_tokens == ran.usage.input_tokens
    assert with_tools.input_tokens > token_count(server, messages=WEATHER_ASK) + 20


def _error(exc: anthropic.APIStatusError, err_type: str, *fragments: str) -> None:
    assert set(exc.body) == {"type", "error"} and exc.body["type"] == "error"
    assert exc.body["error"]["type"] == err_type
    for fragment in fragments:
        assert fragment in exc.body["error"]["message"]


def test_errors_take_anthropics_shape_and_types(server):
    c = _anthropic(server)
    user = [{"role": "user", "content": ASK}]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=0, messages=user)
    _error(e.value, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=user, stop_sequences=[""])
    _error(e.value, "invalid_request_error", "stop_sequences")
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-4", max_tokens=4, messages=user)
    _error(e.value, "not_found_error", "claude-opus-4")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    _error(e.value, "invalid_request_error", "messages.0.content.0", "image", "text only")
    # A body pydantic refuses: the field named, still in Anthropic's shape.
    r = httpx.post(f"{server.v1}/messages", json={"model": MODEL, "messages": user}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    # Other routes keep the OpenAI shape.
    r = httpx.post(f"{server.v1}/chat/completions", json={"model": "nope", "messages": user})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_api_key_in_x_api_key(limited_server):
    s = limited_server
    user = [{"role": "user", "content": ASK}]
    with pytest.raises(anthropic.AuthenticationError) as e:
        _anthropic(s, api_key="wrong").messages.create(model="smol", max_tokens=2, messages=user)
    _error(e.value, "authentication_error", "x-api-key")
    # The SDK sends its key as x-api-key; every /v1 route takes it.
    message = _anthropic(s).messages.create(model="smol", max_tokens=2, messages=user)
    assert message.usage.output_tokens == 2 and message.model == "smol"
    r = httpx.get(f"{s.v1}/models", headers={"x-api-key": s.api_key}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
    # --max-request-body-bytes, refused before the body is read: Anthropic's 413.
    big = [{"role": "user", "content": "x" * MAX_REQUEST_BODY_BYTES}]
    with pytest.raises(anthropic.APIStatusError) as e:
        _anthropic(s).messages.create(model="smol", max_tokens=2, messages=big)
    assert e.value.status_code == 413
    _error(e.value, "request_too_large", "--max-request-body-bytes")


def test_a_full_queue_is_overloaded_529(limited_server):
    """limited_server runs one sequence and queues one: a third request is Anthropic's
    overloaded_error (529, with Retry-After), which the SDK raises as OverloadedError."""
    s = limited_server
    with full_queue(s) as waited:
        with pytest.raises(anthropic.OverloadedError) as e:
            _anthropic(s).messages.create(
                model="smol", max_tokens=2, messages=[{"role": "user", "content": ASK}]
            )
        assert e.value.status_code == 529 and e.value.response.headers["retry-after"] == "1"
        _error(e.value, "overloaded_error", "queue is full")
    assert waited == [200]


def test_a_stream_left_early_and_every_answer_free_their_blocks(server):
    c = _anthropic(server)
    with c.messages.stream(
        model=MODEL, max_tokens=1000, messages=[{"role": "user", "content": "Write a long story."}]
    ) as stream:
        assert next(iter(stream.text_stream))
    deadline = time.monotonic() + 10
    while metric(server, "pagedserve_kv_blocks_used") or metric(
        server, "pagedserve_num_requests_running"
    ):
        assert time.monotonic() < deadline, "a /v1/messages request still holds blocks"
        time.sleep(0.05)
