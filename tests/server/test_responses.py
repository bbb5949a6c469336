"""OpenAI's Responses API (/v1/responses) with the official `openai` client against a real server
and the real SmolLM2: greedy answers equal /v1/chat/completions' for the same conversation,
whole and streamed (`client.responses.stream`, which checks the events as it accumulates
them), max_output_tokens, function calls and their outputs, text.format through the
structured-output path (`client.responses.parse`), previous_response_id, store, GET and DELETE,
and OpenAI-shaped errors. The stream's events for reasoning and a failure are checked on chat
chunks given by hand (SmolLM2 does not reason)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pydantic
import pytest
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from pagedserve.server.errors import APIError
from pagedserve.server.openai.responses_output import response_events
from pagedserve.server.openai.serving_responses import ResponseStore, StoredResponse
from tests.server.util import client, metric

MODEL = "smollm2-135m-instruct"
GREEDY = {"model": MODEL, "temperature": 0}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {  # the Responses shape
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
WEATHER_CHAT_TOOL = {  # the same tool in the chat shape
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": WEATHER_PARAMETERS,
        "strict": True,
    },
}


def _chat(c: openai.OpenAI, messages: list[dict], max_tokens: int, **kwargs):
    return c.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def test_create_equals_chat(server):
    c = client(server)
    ask = "What is the capital of France?"
    r = c.responses.create(input=ask, max_output_tokens=30, **GREEDY)
    chat = _chat(c, [{"role": "user", "content": ask}], 30)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert "Paris" in r.output_text
    assert chat.choices[0].finish_reason == "stop"
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    (message,) = r.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens
    assert (r.temperature, r.max_output_tokens, r.model) == (0, 30, MODEL)


def test_instructions_and_max_output_tokens_is_incomplete(server):
    c = client(server)
    ask, system = "Tell me a long story about a dragon.", "You are a poet."
    r = c.responses.create(
        input=ask,
        instructions=system,
        max_output_tokens=4,
        reasoning={"effort": "low", "summary": "auto"},  # accepted: SmolLM2 does not reason
        **GREEDY,
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
    chat = _chat(c, messages, 4)
    assert r.output_text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 4
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert (r.instructions, r.reasoning.effort) == (system, "low")


def test_stream_equals_whole(server):
    c = client(server)
    kwargs = dict(input="Name three colors.", max_output_tokens=25, **GREEDY)
    whole = c.responses.create(**kwargs)
    with c.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert c.responses.retrieve(final.id).output_text == whole.output_text  # stored, too


def test_function_call_round_trip(server):
    c = client(server)
    ask = "What is the weather in Paris?"
    forced = {"type": "function", "name": "get_weather"}
    r1 = c.responses.create(
        input=ask, tools=[WEATHER_TOOL], tool_choice=forced, max_output_tokens=40, **GREEDY
    )
    (call,) = r1.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    # The forced call streamed: its arguments come as deltas, and equal the whole answer's.
    with c.responses.stream(
        input=ask, tools=[WEATHER_TOOL], tool_choice=forced, max_output_tokens=40, **GREEDY
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == streamed.output[0].arguments == call.arguments

    # The tool's result continues the conversation, as chat continues it given all of it.
    result = "22 degrees and sunny"
    r2 = c.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        previous_response_id=r1.id,
        tools=[WEATHER_TOOL],
        tool_choice="none",  # an answer in words this time
        max_output_tokens=20,
        **GREEDY,
    )
    chat = _chat(
        c,
        [
            {"role": "user", "content": ask},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        20,
        tools=[WEATHER_CHAT_TOOL],
        tool_choice="none",
    )
    assert r2.previous_response_id == r1.id
    assert r2.output_text == chat.choices[0].message.content and r2.output_text


def test_text_format_json_schema_parses(server):
    c = client(server)
    ask = "Which city is the capital of Italy? Answer in JSON."
    r = c.responses.parse(input=ask, text_format=City, max_output_tokens=40, **GREEDY)
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    chat = c.chat.completions.parse(
        messages=[{"role": "user", "content": ask}],
        response_format=City,
        max_tokens=40,
        **GREEDY,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.output_parsed == chat.choices[0].message.parsed


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first, second = "My name is Ada. Say hello to me.", "What is my name?"
    r1 = c.responses.create(input=first, max_output_tokens=20, **GREEDY)
    r2 = c.responses.create(
        input=second, previous_response_id=r1.id, max_output_tokens=20, **GREEDY
    )
    chat = _chat(
        c,
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": second},
        ],
        20,
    )
    assert r2.output_text == chat.choices[0].message.content
    # The whole conversation is the prompt: the first turn's tokens are in it.
    assert r2.usage.input_tokens == chat.usage.prompt_tokens > r1.usage.input_tokens


def test_store_get_delete(server):
    c = client(server)
    kept = c.responses.create(input="Say yes.", max_output_tokens=3, metadata={"k": "v"}, **GREEDY)
    got = c.responses.retrieve(kept.id)
    assert got.model_dump() == kept.model_dump()
    assert got.metadata == {"k": "v"} and got.store is True
    c.responses.delete(kept.id)
    for call in (c.responses.retrieve, c.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(kept.id)
        assert e.value.body["param"] == "response_id" and kept.id in e.value.body["message"]

    unstored = c.responses.create(input="Say no.", max_output_tokens=3, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="Go on.", previous_response_id=unstored.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def test_bad_requests(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="Hi", previous_response_id="resp_unknown", **GREEDY)
    assert e.value.body == {
        "message": "Previous response with id 'resp_unknown' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input="Hi", tools=[{"type": "web_search"}], **GREEDY)
    assert e.value.body["param"] == "tools" and "tools[0]" in e.value.body["message"]
    cases = [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ]
    for body, param in cases:
        r = httpx.post(f"{server.v1}/responses", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_a_stream_left_early_frees_its_blocks(server):
    c = client(server)
    with c.responses.stream(input="Write a long story.", max_output_tokens=1000, **GREEDY) as s:
        assert next(e for e in s if e.type == "response.output_text.delta").delta
    deadline = time.monotonic() + 10
    while metric(server, "pagedserve_kv_blocks_used") or metric(
        server, "pagedserve_num_requests_running"
    ):
        assert time.monotonic() < deadline, "a /v1/responses stream still holds blocks"
        time.sleep(0.05)


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a").response == {"id": "a"} and store.get("c").response == {"id": "c"}
    assert store.delete("a") and not store.delete("a")


# ---- the stream's events, from chat chunks given by hand ---------------------------------------


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _frames(chunks: list[dict | Exception]) -> tuple[list[dict], list[dict]]:
    async def chat_chunks():
        for chunk in chunks:
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk

    finished: list[dict] = []
    response = {"id": "resp_x", "object": "response", "created_at": 0.0, "model": MODEL}
    response |= {"status": "in_progress", "output": [], "tools": [], "tool_choice": "auto"}
    response |= {"parallel_tool_calls": True}
    frames = [f async for f in response_events(chat_chunks(), response, finished.append)]
    events = []
    for frame in frames:
        head, data = frame.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events, finished


def test_stream_events_of_reasoning_and_a_call():
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    call = {"index": 0, "id": "call_1", "type": "function"}
    events, (final,) = asyncio.run(
        _frames(
            [
                _chunk({"role": "assistant", "content": ""}),
                _chunk({"reasoning_content": "The user "}),
                _chunk({"reasoning_content": "asks."}),
                _chunk({"content": "Let me look."}),
                _chunk({"tool_calls": [call | {"function": {"name": "f", "arguments": '{"a"'}}]}),
                _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
                _chunk({}, "tool_calls"),
                {"choices": [], "usage": usage},
            ]
        )
    )
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in events:  # the official client's own checks of the stream
        state.handle_event(openai._models.construct_type(type_=ResponseStreamEvent, value=event))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning, message, function_call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user asks."}]
    assert message["content"][0]["text"] == "Let me look."
    assert (function_call["call_id"], function_call["arguments"]) == ("call_1", '{"a": 1}')
    assert final["usage"]["output_tokens"] == 5 and final["status"] == "completed"
    assert events[-1]["response"] == final


def test_stream_failure_is_an_error_then_failed():
    failure = APIError(500, "the request failed: boom", code="request_failed")
    events, finished = asyncio.run(_frames([_chunk({"content": "Hal"}), failure]))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "request_failed"
    assert events[-2]["message"] == "the request failed: boom"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "the request failed: boom"
    assert finished == []  # nothing stored
