"""Tool calling over HTTP with the official `openai` client against a real server and the real
SmolLM2 (whose chat template has no tools: they go into a system message): a named
tool_choice and "required" constrain the answer to valid calls, "auto" reads the model's own
Hermes-style calls, streams carry delta.tool_calls as OpenAI sends them, a conversation goes
on with the tool's result; bad tools are OpenAI-shaped 400s. The parsing itself is tested on
strings too, and a template that takes `tools` gets them."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest

from pagedserve.server.errors import APIError
from pagedserve.server.openai.tool_calls import ToolCallStream, plan_tools
from tests.server.util import client

MODEL = "smollm2-135m-instruct"


class WeatherQuery(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    days: int = pydantic.Field(ge=1, le=7)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": WeatherQuery.model_json_schema(),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What will the weather be in Paris this week?"}]


def _reassemble(chunks) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls from streamed deltas, as a client joins them: by index, id/name from the
    first fragment, arguments concatenated."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for fragment in choice.delta.tool_calls or []:
            call = calls.setdefault(fragment.index, {"id": None, "name": None, "arguments": ""})
            if fragment.id:
                assert call["id"] is None  # the id comes once, first
                call["id"], call["name"] = fragment.id, fragment.function.name
                assert fragment.type == "function"
            call["arguments"] += fragment.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish, content


def test_a_named_tool_choice_returns_one_valid_call_ten_times_out_of_ten(server):
    c = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def run():
        return await asyncio.gather(
            *(
                c.chat.completions.create(
                    model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                    temperature=1.0, seed=i, max_tokens=200,
                )
                for i in range(10)
            )
        )  # fmt: skip

    for r in asyncio.run(run()):
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content is None
        assert call.type == "function" and call.function.name == "get_weather"
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        WeatherQuery.model_validate_json(call.function.arguments)


def test_a_streamed_named_call_reassembles_to_the_same_call(server):
    c = client(server)
    kwargs = dict(
        model=MODEL, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=4, max_tokens=200,
    )  # fmt: skip
    whole = c.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(c.chat.completions.create(**kwargs, stream=True))
    calls, finish, content = _reassemble(chunks)
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == whole.function.arguments
    # The arguments arrive in pieces as they are generated.
    assert sum(1 for ch in chunks if ch.choices[0].delta.tool_calls) > 3


def test_required_calls_one_of_the_tools_with_valid_arguments(server):
    c = client(server)
    for seed in range(3):
        r = c.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        if call.function.name == "get_weather":
            WeatherQuery.model_validate_json(call.function.arguments)
        else:
            assert call.function.name == "get_time"
            assert set(json.loads(call.function.arguments)) == {"city"}


# The model's own call, forced through a regex so that the test does not depend on what the
# small model chooses: "auto" must find it in the text, whole or streamed.
HERMES_ANSWER = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius", "days": [1-7]\}\}\n</tool_call>'
)


def test_auto_reads_the_models_own_hermes_call_whole_and_streamed(server):
    c = client(server)
    kwargs = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=2,
        max_tokens=120, extra_body={"structured_outputs": {"regex": HERMES_ANSWER}},
    )  # fmt: skip
    r = c.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    query = WeatherQuery.model_validate_json(call.function.arguments)
    calls, finish, content = _reassemble(c.chat.completions.create(**kwargs, stream=True))
    assert (finish, content.strip()) == ("tool_calls", "Let me check.")
    assert "<tool_call>" not in content  # the call's text never streams as content
    assert calls[0]["name"] == "get_weather"
    assert WeatherQuery.model_validate_json(calls[0]["arguments"]) == query


def test_the_conversation_goes_on_with_the_tools_result(server):
    c = client(server)
    arguments = '{"city": "Paris", "unit": "celsius", "days": 1}'
    call = {
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"forecast": "sunny, 24 C"}'},
    ]
    r = c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content  # an answer in words, not another call
    # tool_choice "none": the same conversation, no tools shown or read.
    r = c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert r.choices[0].message.tool_calls is None


BAD = [
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
        "tool_choice", "names the function 'fly', which is not among the tools", id="unknown-name",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]},
        "tools", r'tools\[0\].function.parameters: invalid JSON schema .*"frobnicate"',
        id="bad-schema",
    ),
    pytest.param(
        {"tools": [{"type": "function"}]}, "tools", r"tools\[0\].function must be",
        id="no-function",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
        "function.name must be 1 to 64 letters", id="bad-name",
    ),
    pytest.param({"tools": [WEATHER, WEATHER]}, "tools", "a second function named", id="twice"),
    pytest.param({"tools": {"a": 1}}, "tools", "tools must be a list", id="not-list"),
    pytest.param(
        {"tool_choice": "required"}, "tool_choice", "tool_choice needs tools", id="no-tools"
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice",
        "must be one of none, auto, required", id="bad-choice",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice", "constrains the output itself", id="two-constraints",
    ),
    pytest.param(
        {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls",
        "must be a boolean", id="parallel",
    ),
    pytest.param(
        {"tools": [WEATHER], "messages": [*ASK, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
        "messages", r"messages\[1\].tool_calls\[0\].function.arguments is not JSON",
        id="bad-arguments",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_bad_tools_are_a_400_naming_the_field(server, fields, param, message):
    with httpx.Client(timeout=30) as http:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
        r = http.post(f"{server.v1}/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert re.search(message, error["message"]), error["message"]
        good = {"model": MODEL, "messages": ASK, "max_tokens": 4}
        assert http.post(f"{server.v1}/chat/completions", json=good).status_code == 200


# ---------------------------------------------------------------------- on strings


def _plan(choice=None, template=None, parallel=True, parser="auto"):
    req = SimpleNamespace(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel)
    return plan_tools(req, template, parser)


def test_parsing_the_models_own_formats():
    hermes = _plan()
    assert hermes.parser == "hermes" and not hermes.template_has_tools
    text = (
        'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]</tool_call>'
    )
    content, calls = hermes.parse(text)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"city": "Rome"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert len(_plan(parallel=False).parse(text)[1]) == 1
    # A malformed block, or a call of a function that is not a tool, is text.
    assert hermes.parse("<tool_call>{oops</tool_call>") == ("<tool_call>{oops</tool_call>", [])
    unknown = '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    assert hermes.parse(unknown) == (unknown, [])
    assert hermes.parse("Just words.") == ("Just words.", [])
    # Llama 3: bare JSON calls with "parameters", maybe after <|python_tag|>, ";"-separated.
    llama = _plan(template="{% if tools %}<|python_tag|>{% endif %}")
    assert (llama.parser, llama.template_has_tools) == ("llama3_json", True)
    content, calls = llama.parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {"city": "Lima"}}'
    )
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "Rome",
        "Lima",
    ]
    assert llama.parse("The time is 3 pm.") == ("The time is 3 pm.", [])


def test_streaming_holds_back_a_call_and_nothing_else():
    stream = ToolCallStream(_plan())
    pieces = [
        "Let me ", "check <", "tool_", 'call>{"name": "get_time", ',
        '"arguments": {"city": "Rome"}}', "</tool_call>",
    ]  # fmt: skip
    sent = [d for p in pieces for d in stream.feed(p)]
    assert sent == [{"content": "Let me "}, {"content": "check "}]  # "<" waited: a tag's start
    tail, called = stream.finish()
    assert called and len(tail) == 1
    (fragment,) = tail[0]["tool_calls"]
    assert fragment["function"] == {"name": "get_time", "arguments": '{"city": "Rome"}'}
    plain = ToolCallStream(_plan())
    assert [d for p in ["a <t", "ab> c"] for d in plain.feed(p)] == [
        {"content": "a "},  # "<t" may begin <tool_call>
        {"content": "<tab> c"},
    ]
    assert plain.finish() == ([], False)


def test_a_template_with_tools_gets_them_and_earlier_calls_as_objects():
    from pagedserve.engine.models.tokenizer import render_chat_prompt, synthetic_tokenizer
    from tests.helpers import tiny_config

    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
    )
    plan = _plan(template=template)
    assert plan.template_has_tools and plan.parser == "hermes"
    function = {"name": "get_time", "arguments": '{"city": "Rome"}'}
    call = {"id": "c", "type": "function", "function": function}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    messages, kwargs = plan.render_messages([*ASK, turn])
    assert kwargs == {"tools": [WEATHER, TIME]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    tokenizer = synthetic_tokenizer(tiny_config())
    text = render_chat_prompt(tokenizer, messages, chat_template=template, template_kwargs=kwargs)
    assert text.startswith("TOOLS:get_weather;get_time;user:")
    assert "assistant:CALL get_time Rome" in text
    # Without tools in the template: a system message lists them, calls become text.
    messages, kwargs = _plan().render_messages([*ASK, {**turn, "content": ""}])
    assert kwargs == {} and messages[0]["role"] == "system"
    assert (
        '"name": "get_weather"' in messages[0]["content"]
        and "<tool_call>" in messages[0]["content"]
    )
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert "tool_calls" not in messages[2]
    with pytest.raises(APIError, match="tool_choice needs tools"):
        plan_tools(SimpleNamespace(tools=None, tool_choice="auto", parallel_tool_calls=True), None)
