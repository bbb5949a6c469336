"""Request bodies of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), as pydantic models.

Content blocks, tools and tool_choice are typed loosely here:
server/anthropic/serving_messages.py checks them while translating them to the chat path's OpenAI
shapes, so that an unsupported block (an image) gets a message saying so rather than a list of
union mismatches. Unknown fields (`service_tier`, `container`, `cache_control` on blocks, ...) are
ignored and logged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from pagedserve.server.request_body import RequestBody


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(RequestBody):
    """What decides the prompt: the conversation and the tools shown to the model."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # {"type": "enabled", "budget_tokens": N}, "disabled", "adaptive" or "between_tools"
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic's API requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted, unused
    # {"format": {"type": "json_schema", "schema": {...}}, "effort": ...}: the format constrains
    # the answer (as response_format does in chat); effort is ignored.
    output_config: dict[str, Any] | None = None
    stream: bool = False
