"""Anthropic's Messages API over the chat path: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (what Claude Code and the `anthropic` SDK speak).

A Messages request becomes a ChatCompletionRequest (`chat_request`: the system prompt a system
message, text blocks OpenAI text parts, `tool_use` blocks assistant `tool_calls`, `tool_result`
blocks `role: "tool"` messages, tools OpenAI functions, tool_choice "any" "required" and
"tool" a named function), runs through the chat path (server/openai/serving_chat.py
`start_chat`, chat_answer.py `chat_body` and `chat_chunks`: the same checks, rendering, sampling
and tool calls) and its output is reshaped: a `message` with text, `tool_use` and `thinking`
blocks, or the stream of Anthropic's events (server/anthropic/messages_stream.py). Errors under
/v1/messages take Anthropic's shape (server/errors.py `error_response`).

Not done: images and documents (a 400: the models served read text only), a final assistant
turn continued as a prefill (it is rendered as a closed turn), thinking `budget_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.server.anthropic.messages_stream import message_events, stop_reason, tool_use_id
from pagedserve.server.anthropic.protocol import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
)
from pagedserve.server.errors import APIError
from pagedserve.server.openai.chat_answer import chat_body
from pagedserve.server.openai.protocol import ChatCompletionRequest
from pagedserve.server.openai.serving_chat import chat_prompt_ids, start_chat
from pagedserve.server.openai.tool_calls import plan_tools
from pagedserve.server.serving_common import ServerState, check_model, warn_unknown_fields

# The chat fields an error may name, by their name in a Messages request.
_FIELD_NAMES = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config",
}
# Blocks of an earlier assistant turn that the prompt leaves out (chat templates drop earlier
# reasoning too).
_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


async def create_message(
    state: ServerState, req: MessagesRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    warn_unknown_fields(req, "/v1/messages")
    try:
        run = start_chat(state, chat_request(req))
    except APIError as e:
        e.param = _FIELD_NAMES.get(e.param, e.param)
        raise
    message_id = "msg_" + run.request_id.removeprefix("chatcmpl-")
    if req.stream:
        return StreamingResponse(
            message_events(state, run, message_id, req.model), media_type="text/event-stream"
        )
    completion = await chat_body(state, run, raw_request)
    return JSONResponse(message_body(completion, message_id, req.model))


def count_tokens(state: ServerState, req: CountTokensRequest) -> dict[str, int]:
    """{"input_tokens": N}: the conversation rendered as /v1/messages renders it, tools
    included."""
    warn_unknown_fields(req, "/v1/messages/count_tokens")
    check_model(state, req.model)
    chat = chat_request(req)
    template = getattr(state.engine.tokenizer, "chat_template", None)
    tools = plan_tools(chat, template, state.tool_call_parser)
    return {"input_tokens": len(chat_prompt_ids(state, chat, tools))}


# ---- request ---------------------------------------------------------------------------------


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that runs a Messages request (or renders a count_tokens one)."""
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": _chat_messages(req.system, req.messages),
    }
    if req.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"], fields["parallel_tool_calls"] = _chat_tool_choice(req.tool_choice)
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": _thinking_enabled(req.thinking)}
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
        if req.output_config is not None:
            fields["response_format"] = _response_format(req.output_config)
    return ChatCompletionRequest(**fields)


def _thinking_enabled(thinking: dict[str, Any]) -> bool:
    """Whether the request asks for reasoning; chat templates that think (Qwen3's) read it as
    `enable_thinking`, the others ignore it."""
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        raise APIError(
            400,
            f"thinking.type must be one of {', '.join(_THINKING_TYPES)}, got {kind!r}",
            param="thinking",
        )
    return kind != "disabled"


def _response_format(output_config: dict[str, Any]) -> dict[str, Any] | None:
    """output_config.format as chat's response_format (which checks the schema)."""
    output_format = output_config.get("format")
    if output_format is None:
        return None
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
        raise APIError(
            400,
            'output_config.format must be {"type": "json_schema", "schema": {...}}',
            param="output_config",
        )
    schema = {"name": "output", "schema": output_format.get("schema")}
    return {"type": "json_schema", "json_schema": schema}


def _chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        content = system if isinstance(system, str) else _text_parts(system, "system")
        out.append({"role": "system", "content": content})
    for i, message in enumerate(messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user_turn(message.content, where))
        else:
            out.append(_assistant_turn(message.content, where))
    return out


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError(400, f"{where} must be a content block with a 'type'", param=where)
    if kind in ("image", "document"):
        raise APIError(
            400,
            f"{where}: {kind} blocks are not supported: the model served reads text only",
            param=where,
        )
    return kind


def _text_of_block(block: dict[str, Any], where: str) -> dict[str, str]:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{where}.text must be a string", param=where)
    return {"type": "text", "text": text}


def _blocks(blocks: list[dict[str, Any]], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, type, block) of each content block, a text block as its OpenAI text part."""
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        yield at, kind, _text_of_block(block, at) if kind == "text" else block


def _text_parts(blocks: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
    """Text blocks as OpenAI text parts (the chat path joins them with newlines)."""
    parts = []
    for at, kind, part in _blocks(blocks, where):
        if kind != "text":
            raise APIError(400, f"{at}: expected a text block, got {kind!r}", param=at)
        parts.append(part)
    return parts


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results become `tool` messages, its text a user message, in the
    order they come."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append(_tool_message(block, at))
        elif kind == "text":
            texts.append(block)
        else:
            raise APIError(400, f"{at}: a user turn holds no {kind!r} blocks", param=at)
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise APIError(400, f"{where}.tool_use_id must be a string", param=where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in _text_parts(content, f"{where}.content"))
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or text blocks", param=where)
    if block.get("is_error"):
        content = f"Error: {content}"  # the model sees that the call failed
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for at, kind, block in _blocks(blocks, where):
        if kind == "text":
            texts.append(block)
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(400, f"{at}: a tool_use block needs an id and a name", param=at)
            if not isinstance(arguments, dict):
                raise APIError(400, f"{at}.input must be an object", param=at)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind not in _DROPPED_BLOCKS:
            raise APIError(400, f"{at}: an assistant turn holds no {kind!r} blocks", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": texts}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """{name, description, input_schema} -> an OpenAI function (plan_tools checks the rest)."""
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise APIError(
            400,
            f"tools.{i}: tools of type {kind!r} (Anthropic's server tools) are not supported; "
            "give custom tools as {name, description, input_schema}",
            param="tools",
        )
    if not isinstance(tool.get("input_schema"), dict):
        raise APIError(400, f"tools.{i}.input_schema must be a JSON schema object", param="tools")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[Any, bool]:
    """(OpenAI tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice {"type": "tool"} needs a name', param="tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise APIError(
        400,
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}",
        param="tool_choice",
    )


# ---- response --------------------------------------------------------------------------------


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "tool_use",
        "id": tool_use_id(call["id"]),
        "name": function["name"],
        "input": json.loads(function["arguments"] or "{}"),
    }


def message_body(chat: dict[str, Any], message_id: str, model: str) -> dict[str, Any]:
    """The `message` object of a whole `chat.completion` (one choice)."""
    (choice,) = chat["choices"]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content.extend(tool_use_block(call) for call in message.get("tool_calls") or ())
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": chat["usage"]["prompt_tokens"],
            "output_tokens": chat["usage"]["completion_tokens"],
        },
    }
