"""The Messages API's translations without a server: a Messages request into the chat request
that runs it, and chat chunks into Anthropic's stream events, read back by the official
`anthropic` client. These cover what SmolLM2 cannot produce on demand (reasoning, a failure
in mid-stream); tests/server/test_messages.py runs the rest against the real server."""

from __future__ import annotations

import asyncio

import anthropic
import httpx2
import pytest

from pagedserve.server.anthropic import messages_stream
from pagedserve.server.anthropic.protocol import MessagesRequest
from pagedserve.server.anthropic.serving_messages import chat_request
from pagedserve.server.errors import APIError
from pagedserve.server.openai.chat_answer import ChatRun


def test_a_conversation_becomes_the_chat_request_that_runs_it():
    req = MessagesRequest(
        model="m",
        max_tokens=5,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "down",
                        "is_error": True,
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },  # fmt: skip
        ],
        tools=[{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        thinking={"type": "disabled"},
    )
    chat = chat_request(req)
    assert chat.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"c": "Oslo"}'},
                },
            ],  # fmt: skip
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
    ]
    assert chat.tools == [
        {"type": "function",
         "function": {"name": "w", "parameters": {"type": "object"}, "description": "weather"}},
    ]  # fmt: skip
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.max_tokens, chat.stop, chat.n) == (5, ["\n\n"], 1)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(APIError, match=r"messages\.0\.content\.1: image blocks"):
        chat_request(
            MessagesRequest(
                model="m",
                max_tokens=5,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is it?"},
                            {"type": "image", "source": {}},
                        ],
                    }
                ],
            )  # fmt: skip
        )


CHUNKS = [
    {"role": "assistant", "content": ""},
    {"reasoning_content": "The user "},
    {"reasoning_content": "wants a call."},
    {"content": "Calling."},
    {"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                     "function": {"name": "w", "arguments": '{"c": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
]  # fmt: skip


def _frames(monkeypatch, fail: bool) -> bytes:
    async def chat_chunks(state, run, include_usage=False):
        for delta in CHUNKS:
            yield {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        if fail:
            raise APIError(504, "the request did not finish in time", code="request_timeout")
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
        yield {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 14}}

    monkeypatch.setattr(messages_stream, "chat_chunks", chat_chunks)
    run = ChatRun("chatcmpl-1", [], 1, None, False, 0, prompt_tokens=9)

    async def collect() -> bytes:
        return b"".join(
            [f.encode() async for f in messages_stream.message_events(None, run, "msg_1", "m")]
        )

    return asyncio.run(collect())


def _client(body: bytes) -> anthropic.Anthropic:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    transport = httpx2.MockTransport(answer)
    return anthropic.Anthropic(
        base_url="http://test",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def test_the_stream_reads_back_as_thinking_text_and_tool_use(monkeypatch):
    body = _frames(monkeypatch, fail=False)
    kinds = [
        line.removeprefix(b"event: ").decode()
        for line in body.split(b"\n")
        if line.startswith(b"event: ")
    ]
    assert kinds == [
        "message_start",
        *[
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
        ],
        *["content_block_start", "content_block_delta", "content_block_stop"],
        *[
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
        ],
        "message_delta",
        "message_stop",
    ]
    with _client(body).messages.stream(model="m", max_tokens=20, messages=[]) as stream:
        message = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in message.content] == [
        {"type": "thinking", "thinking": "The user wants a call.", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_7", "name": "w", "input": {"c": "Oslo"}},
    ]
    assert (message.id, message.stop_reason, message.stop_sequence) == ("msg_1", "tool_use", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 14)


def test_a_failure_in_mid_stream_is_an_error_event(monkeypatch):
    body = _frames(monkeypatch, fail=True)
    assert body.endswith(
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
        b'"message":"the request did not finish in time"}}\n\n'
    )
    with pytest.raises(anthropic.APIStatusError) as e:
        with _client(body).messages.stream(model="m", max_tokens=20, messages=[]) as stream:
            stream.get_final_message()
    assert e.value.body == {
        "type": "error",
        "error": {"type": "timeout_error", "message": "the request did not finish in time"},
    }
