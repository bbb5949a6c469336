"""The Messages API's answer shapes shared by whole and streamed messages, and the stream itself:
Anthropic's server-sent events, made from a chat run's `chat.completion.chunk`s.

The events, as Anthropic sends them and its SDK parses them (each frame
`event: <type>\\ndata: <json with the same "type">\\n\\n`): `message_start` (the message with no
content yet, its input tokens), then per content block `content_block_start`,
`content_block_delta`s (`text_delta`, `thinking_delta`, `input_json_delta` with the tool call's
arguments as they come) and `content_block_stop`, then `message_delta` (stop_reason,
stop_sequence, output tokens) and `message_stop`. A failure after the start is an
`event: error` frame with Anthropic's error body, and the stream ends there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pagedserve.server.errors import anthropic_error, as_api_error
from pagedserve.server.openai.chat_answer import ChatRun, chat_chunks, delta_events
from pagedserve.server.serving_common import ServerState


def stop_reason(finish_reason: str | None, stop: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):  # a stop string matched (a stop token id is an end of turn)
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def event(kind: str, data: dict[str, Any]) -> str:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


class _Blocks:
    """The content blocks of a streamed message: a delta of another kind than the open block's
    (or a new tool call) closes it and opens the next."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # of the open block

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]

    def _open(self, block: dict[str, Any]) -> list[str]:
        frames = self.close()
        self.index += 1
        self.kind = block["type"]
        frames.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return frames

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def text(self, text: str) -> list[str]:
        frames = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        return [*frames, self._delta({"type": "text_delta", "text": text})]

    def reasoning(self, text: str) -> list[str]:
        frames = []
        if self.kind != "thinking":
            frames = self._open({"type": "thinking", "thinking": "", "signature": ""})
        return [*frames, self._delta({"type": "thinking_delta", "thinking": text})]

    def tool_call(self, fragment: dict[str, Any]) -> list[str]:
        """An OpenAI tool-call fragment: the first of a call (with its id) opens a tool_use
        block; the arguments of every fragment are the call's input JSON, piece by piece."""
        function = fragment.get("function") or {}
        frames = []
        if fragment.get("id"):
            block = {
                "type": "tool_use",
                "id": tool_use_id(fragment["id"]),
                "name": function.get("name"),
                "input": {},
            }
            frames = self._open(block)
        arguments = function.get("arguments")
        if arguments and self.kind == "tool_use":
            frames.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return frames


async def message_events(
    state: ServerState, run: ChatRun, message_id: str, model: str
) -> AsyncIterator[str]:
    """The SSE frames of a streamed message. Leaving early (a client that disconnects) aborts
    the run."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0},
    }
    yield event("message_start", {"message": start})
    blocks = _Blocks()
    finish: str | None = None
    stop: str | int | None = None
    output_tokens = 0
    chunks = chat_chunks(state, run, include_usage=True)
    try:
        async with aclosing(chunks):  # closing this generator aborts the run at once
            async for chunk in chunks:
                if chunk.get("usage"):
                    output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    for frame in delta_events(blocks, choice["delta"]):
                        yield frame
                    if choice.get("finish_reason") is not None:
                        finish, stop = choice["finish_reason"], choice.get("stop_reason")
    except Exception as e:  # the request failed or timed out: tell the client in-band
        yield event("error", {"error": anthropic_error(as_api_error(e))[1]["error"]})
        return
    for frame in blocks.close():
        yield frame
    reason, sequence = stop_reason(finish, stop)
    yield event(
        "message_delta",
        {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output_tokens},
        },
    )
    yield event("message_stop", {})
