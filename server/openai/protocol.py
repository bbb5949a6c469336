"""Request bodies of the completions, chat and tokenizer routes (pydantic). Responses are built
as plain dicts in the serving modules: they are written once per token in streams, where pydantic
would only add cost.

Field names and defaults follow the OpenAI API; the extra sampling fields (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, ...) follow vLLM, so `extra_body={...}` from the
official client works the same against both. Unknown fields are ignored (and logged), as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from pagedserve.server.request_body import RequestBody


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(RequestBody):
    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None -> 1.0, the OpenAI default
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # {token id as a string: bias in [-100, 100]} (OpenAI); vLLM's min_tokens, bad_words and
    # allowed_token_ids. Typed loosely: SamplingParams' checks name the field of a bad value.
    logit_bias: dict[str, Any] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool = False  # as vLLM: the beam width is n
    length_penalty: float = 1.0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs ({"json" |
    # "regex" | "choice" | "grammar" | "json_object": ...}) and its older guided_* fields.
    # Typed loosely here: server/openai/structured_outputs.py checks them, naming the field.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt's logprobs (this many alternatives), as `prompt_logprobs` in the body.
    prompt_logprobs: int | None = None
    # Checked by server/openai/tool_calls.py, which names the field of a bad one.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = True


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
