"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` (what Codex-style clients speak).

A Responses request becomes a ChatCompletionRequest (`chat_request`: instructions a system
message first, the conversation of `previous_response_id` before the input, message items chat
messages, `function_call` items assistant `tool_calls`, `function_call_output` items
`role: "tool"` messages, reasoning items left out as chat templates leave earlier reasoning
out, function tools OpenAI chat functions, `text.format` a `response_format`), runs through the
chat path (server/openai/serving_chat.py `start_chat`, chat_answer.py `chat_body` and
`chat_chunks`: the same checks, rendering, sampling, structured outputs and tool calls) and its
output is reshaped into output items
(server/openai/responses_output.py), whole or streamed.

Responses are kept (unless `store: false`) in a bounded in-memory store, least recently used
first out, with the conversation that produced them, for `previous_response_id`, GET and DELETE.
As OpenAI does, a continued conversation does not carry the earlier `instructions` over.

Not done: images, files and audio in the input (a 400: the models served read text only),
built-in tools (web search, file search, ...: a 400 naming tools), `background`,
`item_reference` items, GET /v1/responses/{id}/input_items, logprobs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.server.errors import APIError
from pagedserve.server.openai.chat_answer import chat_body, chat_chunks
from pagedserve.server.openai.protocol import ChatCompletionRequest
from pagedserve.server.openai.protocol_responses import ResponsesRequest
from pagedserve.server.openai.responses_output import (
    OutputItems,
    finished_response,
    response_events,
)
from pagedserve.server.openai.serving_chat import start_chat
from pagedserve.server.serving_common import ServerState, warn_unknown_fields

# Responses kept for previous_response_id, GET and DELETE; the least recently used go first.
MAX_STORED_RESPONSES = 1000
# The chat fields an error may name, by their name in a Responses request.
_FIELD_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    # Its input items and output items, after those of the responses it continues: what a
    # request naming it as previous_response_id puts before its own input.
    conversation: list[dict[str, Any]]


class ResponseStore:
    """At most `capacity` responses, the least recently used dropped first. Used from the
    event loop's thread only."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)


class ResponsesAPI:
    """The three routes' handlers over one store."""

    def __init__(self, state: ServerState, store: ResponseStore | None = None) -> None:
        self.state = state
        self.store = store if store is not None else ResponseStore()

    async def create(
        self, req: ResponsesRequest, raw_request: Request
    ) -> JSONResponse | StreamingResponse:
        warn_unknown_fields(req, "/v1/responses")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id {req.previous_response_id!r} not found.",
                    param="previous_response_id",
                )
            history = previous.conversation
        items = input_items(req.input)
        chat = chat_request(req, history + items)
        try:
            run = start_chat(self.state, chat)
        except APIError as e:
            e.param = _FIELD_NAMES.get(e.param, e.param)
            raise
        response = in_progress(req, "resp_" + run.request_id.removeprefix("chatcmpl-"), self.state)

        def keep(final: dict[str, Any]) -> None:
            if req.store:
                conversation = history + items + final["output"]
                self.store.put(final["id"], StoredResponse(final, conversation))

        if req.stream:
            chunks = chat_chunks(self.state, run, include_usage=True)
            return StreamingResponse(
                response_events(chunks, response, keep), media_type="text/event-stream"
            )
        body = await chat_body(self.state, run, raw_request)
        (choice,) = body["choices"]
        final = finished_response(
            response, whole_output(choice), choice["finish_reason"], body["usage"]
        )
        keep(final)
        return JSONResponse(final)

    def get(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param="response_id")


def whole_output(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a whole chat choice: its reasoning, its text, its calls."""
    message = choice["message"]
    out = OutputItems()
    if message.get("reasoning_content"):
        out.reasoning(message["reasoning_content"])
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        out.text(content)
    for i, call in enumerate(calls):
        out.tool_call({"index": i, **call})
    out.finish(choice["finish_reason"])
    return out.items


def in_progress(req: ResponsesRequest, response_id: str, state: ServerState) -> dict[str, Any]:
    """The response before any output: what the request asked for, echoed."""
    text = dict(req.text or {})
    text.setdefault("format", {"type": "text"})
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),  # whole seconds, as OpenAI sends them
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "model": req.model or state.model_name,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "store": req.store,
        # The OpenAI defaults, which the chat path applies too.
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": text,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": req.tools or [],
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


# ---- request ---------------------------------------------------------------------------------


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that runs a Responses request over the conversation `items`."""
    messages = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += chat_messages(items)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        fields["response_format"] = _response_format(req.text.get("format"))
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # templates that think (Qwen3's) read this; the others ignore it
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    return ChatCompletionRequest(**fields)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items; function calls that follow an assistant turn
    join it."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(
                    400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                    param="input",
                )  # fmt: skip
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":  # earlier reasoning is left out, as chat templates do
            raise APIError(
                400,
                f"{where}: items of type {kind!r} are not supported; use message, function_call, "
                "function_call_output or reasoning items",
                param="input",
            )
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return value


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": text} for text in _texts(content, f"{where}.content")]


def _parts_text(parts: Any, where: str) -> str:
    return "\n".join(_texts(parts, where))


def _texts(parts: Any, where: str) -> list[str]:
    if not isinstance(parts, list):
        raise APIError(400, f"{where} must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS:
            raise APIError(
                400,
                f"{where}[{j}]: parts of type {kind!r} are not supported: the model served reads "
                f"text only ({', '.join(_TEXT_PARTS[:2])})",
                param="input",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", param="input")
        texts.append(part["text"])
    return texts


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool, {"type": "function", "name", "description", "parameters", "strict"},
    in the chat shape; the other kinds (built-in tools) this server does not run."""
    kind = tool.get("type")
    if kind != "function":
        raise APIError(
            400,
            f"tools[{i}] has type {kind!r}: only function tools are supported "
            '({"type": "function", "name": ..., "parameters": {...}})',
            param="tools",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    if function.get("parameters") is None:
        function.pop("parameters", None)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # "auto", "none", "required": chat checks them
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(
        400,
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}, '
        f"got {choice!r}",
        param="tool_choice",
    )


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format, which the structured-output path checks."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(
        400,
        f'text.format type must be "text", "json_schema" or "json_object", got {fmt!r}',
        param="text.format",
    )
