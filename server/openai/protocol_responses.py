"""The request body of OpenAI's Responses API (`POST /v1/responses`), as a pydantic model.

Input items, tools, tool_choice and text.format are typed loosely here:
server/openai/serving_responses.py checks them while translating them to the chat path's shapes, so
that an unsupported item or tool gets a message naming it rather than a list of union
mismatches. Unknown fields (`include`, `truncation`, `service_tier`, ...) are ignored and
logged, as on the other endpoints.
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.request_body import RequestBody


class ResponsesRequest(RequestBody):
    model: str | None = None
    # A user message's text, or a list of items: messages, function_call,
    # function_call_output and reasoning items (the last skipped when replayed).
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the conversation
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: accepted
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
