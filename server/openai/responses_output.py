"""The Responses API's output, whole or streamed, made from a chat run's output.

`OutputItems` turns chat output (reasoning, text, tool call fragments) into Responses output
items (`reasoning`, `message`, `function_call`) and the events that announce them; a whole
answer goes through it too, so both have the same shape. `response_events` is the stream, as
OpenAI sends it and its SDK checks it (each frame `event: <type>\\ndata: <json with the same
"type" and a "sequence_number">\\n\\n`): response.created, response.in_progress, per item
response.output_item.added, its content (response.content_part.added,
response.output_text.delta / response.reasoning_text.delta ... .done, response.content_part.done;
or response.function_call_arguments.delta ... .done) and response.output_item.done, then
response.completed or response.incomplete with the whole response. A failure after the start is
an `error` event, then response.failed, and the stream ends there.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pagedserve.server.errors import as_api_error
from pagedserve.server.openai.chat_answer import delta_events

Event = tuple[str, dict[str, Any]]  # (type, fields other than type and sequence_number)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_status(finish_reason: str | None) -> str:
    """An item's (and the response's) status: a sample cut by max_output_tokens is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


class OutputItems:
    """A response's output items, built as the chat output comes: output of another kind than
    the open item's (or a new tool call) closes it and opens the next."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []  # the open item's text or arguments so far
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item

    def _start(self, item: dict[str, Any]) -> list[Event]:
        events = self.close()
        part = _part(item["type"], "")
        if part is not None:
            item["content"] = []  # filled when the item closes
        self.items.append(item)
        self._open, self._pieces = item, []
        added = {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)}
        events.append(("response.output_item.added", added))
        if part is not None:
            events.append(("response.content_part.added", {**self._where(), "part": part}))
        return events

    def _where(self) -> dict[str, Any]:
        fields = {"item_id": self._open["id"], "output_index": len(self.items) - 1}
        if self._open["type"] != "function_call":
            fields["content_index"] = 0
        return fields

    def _go_on(self, kind: str, id_prefix: str, fields: dict[str, Any]) -> list[Event]:
        """Nothing while an item of `kind` is open; else the events that open a new one."""
        if self._open is not None and self._open["type"] == kind:
            return []
        item = {"id": item_id(id_prefix), "type": kind, **fields, "status": "in_progress"}
        return self._start(item)

    def reasoning(self, text: str) -> list[Event]:
        events = self._go_on("reasoning", "rs", {"summary": []})
        self._pieces.append(text)
        events.append(("response.reasoning_text.delta", {**self._where(), "delta": text}))
        return events

    def text(self, text: str) -> list[Event]:
        events = self._go_on("message", "msg", {"role": "assistant"})
        self._pieces.append(text)
        delta = {**self._where(), "delta": text, "logprobs": []}
        events.append(("response.output_text.delta", delta))
        return events

    def tool_call(self, fragment: dict[str, Any]) -> list[Event]:
        """A chat `tool_calls` delta: the first of a call has its id and name, the later ones
        more of its arguments."""
        function = fragment.get("function") or {}
        events = []
        if fragment.get("id") is not None:
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "call_id": fragment["id"],
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            events = self._start(item)
            self._calls[fragment.get("index", 0)] = item
        elif self._calls.get(fragment.get("index", 0)) is not self._open:
            return []  # more arguments of a call that is not the open one: never sent by chat
        arguments = function.get("arguments") or ""
        if arguments:
            self._pieces.append(arguments)
            delta = {**self._where(), "delta": arguments}
            events.append(("response.function_call_arguments.delta", delta))
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close the open item: its whole text or arguments, and the item done."""
        item = self._open
        if item is None:
            return []
        whole = "".join(self._pieces)
        where = self._where()
        events: list[Event] = []
        kind = item["type"]
        if kind == "function_call":
            item["arguments"] = whole
            done = {**where, "name": item["name"], "arguments": whole}
            events.append(("response.function_call_arguments.done", done))
        else:
            if kind == "message":
                events.append(
                    ("response.output_text.done", {**where, "text": whole, "logprobs": []})
                )
            else:
                events.append(("response.reasoning_text.done", {**where, "text": whole}))
            item["content"] = [_part(kind, whole)]
            events.append(("response.content_part.done", {**where, "part": item["content"][0]}))
        item["status"] = status
        events.append(
            ("response.output_item.done", {"output_index": where["output_index"], "item": item})
        )
        self._open, self._pieces = None, []
        return events

    def finish(self, finish_reason: str | None) -> list[Event]:
        """The last events: the open item closed. An answer with no output at all is an empty
        message, as a whole answer's is."""
        events = [] if self.items else self.text("")
        return events + self.close(item_status(finish_reason))


def _part(kind: str, text: str) -> dict[str, Any] | None:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return None


def response_usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    """A chat `usage` in the Responses shape. The engine does not report how much of a prompt
    its prefix cache held, nor reasoning tokens apart: those stay 0."""
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def finished_response(
    response: dict[str, Any],
    items: list[dict[str, Any]],
    finish_reason: str | None,
    chat_usage: dict[str, int] | None,
) -> dict[str, Any]:
    """The response once its run has finished (`response` is the in-progress one)."""
    status = item_status(finish_reason)
    return {
        **response,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": items,
        "usage": response_usage(chat_usage),
    }


def _frame(kind: str, fields: dict[str, Any], sequence_number: int) -> str:
    data = {"type": kind, "sequence_number": sequence_number, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def response_events(
    chunks: AsyncIterator[dict[str, Any]],
    response: dict[str, Any],
    on_finished: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The SSE frames of a streamed response made from a chat run's chunks (with their usage
    chunk); `response` is the in-progress response, `on_finished` gets the finished one (to
    store it) before the last frame is sent."""
    numbers = itertools.count()
    yield _frame("response.created", {"response": response}, next(numbers))
    yield _frame("response.in_progress", {"response": response}, next(numbers))
    out = OutputItems()
    finish_reason, chat_usage = None, None
    try:
        async with aclosing(chunks):  # leaving early aborts the request at once, not at GC
            async for chunk in chunks:
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk["choices"]:
                    for kind, fields in delta_events(out, choice["delta"]):
                        yield _frame(kind, fields, next(numbers))
                    finish_reason = choice.get("finish_reason") or finish_reason
    except Exception as e:  # the request failed or the engine died: tell the client in-band
        err = as_api_error(e)
        error = {"code": err.code or err.type, "message": err.message, "param": err.param}
        yield _frame("error", error, next(numbers))
        failed = {
            **response,
            "status": "failed",
            "output": out.items,
            "error": {"code": "server_error", "message": err.message},
        }
        yield _frame("response.failed", {"response": failed}, next(numbers))
        return
    for kind, fields in out.finish(finish_reason):
        yield _frame(kind, fields, next(numbers))
    final = finished_response(response, out.items, finish_reason, chat_usage)
    on_finished(final)
    last = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield _frame(last, {"response": final}, next(numbers))
