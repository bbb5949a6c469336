"""POST /v1/chat/completions: the request checked, its messages rendered with the model's chat
template and queued as a chat run (`start_chat`, which the Responses and Messages APIs run too),
answered whole or streamed (server/openai/chat_answer.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.models.tokenizer import apply_chat_template
from pagedserve.scheduler.sampling_params import MAX_LOGPROBS
from pagedserve.server.errors import APIError
from pagedserve.server.openai.chat_answer import ChatRun, chat_body, chat_chunks
from pagedserve.server.openai.protocol import ChatCompletionRequest, TokenizeRequest
from pagedserve.server.openai.reasoning import PROMPT_TAIL_TOKENS, ReasoningPlan, reasoning_plan
from pagedserve.server.openai.sampling import check_max_tokens, sampling_params
from pagedserve.server.openai.structured_outputs import structured_outputs_of
from pagedserve.server.openai.tool_calls import ToolPlan, plan_tools
from pagedserve.server.serving_common import (
    ServerState,
    add_requests,
    check_model,
    new_id,
    sse_stream,
    warn_unknown_fields,
)


def chat_prompt_ids(
    state: ServerState,
    req: ChatCompletionRequest | TokenizeRequest,
    tools: ToolPlan | None = None,
) -> list[int]:
    """Token ids of the conversation (also used by /tokenize with messages), with the tools
    shown to the model."""
    messages, template_kwargs = req.messages, req.chat_template_kwargs
    if tools is not None:
        messages, extra = tools.render_messages(messages)
        template_kwargs = {**(template_kwargs or {}), **extra}
    return apply_chat_template(
        state.engine.tokenizer,
        messages,
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=template_kwargs,
    )


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    warn_unknown_fields(req, "/v1/chat/completions")
    run = start_chat(state, req)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(
            sse_stream(chat_chunks(state, run, include_usage)), media_type="text/event-stream"
        )
    return JSONResponse(await chat_body(state, run, raw_request))


def start_chat(state: ServerState, req: ChatCompletionRequest) -> ChatRun:
    """Check the request (a 400 names the field), render the conversation and queue it."""
    lora = check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    tools = plan_tools(req, getattr(tokenizer, "chat_template", None), state.tool_call_parser)
    forced = tools.constraint() if tools is not None else None
    own = structured_outputs_of(req)
    if forced is not None and own is not None:
        raise APIError(
            400,
            f"tool_choice {tools.choice!r} constrains the output itself: drop response_format "
            "and the other structured output fields",
            param="tool_choice",
        )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                param="top_logprobs",
            )
    prompt = state.engine.process_prompt(chat_prompt_ids(state, req, tools))
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = check_max_tokens(requested, len(prompt.token_ids), state.engine.max_model_len)
    top_k = req.top_logprobs or 0
    reasoning = _reasoning_plan(state, prompt.token_ids)
    constrain = forced or own
    if reasoning is not None:  # the answer after the reasoning is what is constrained
        constrain = reasoning.constrain(constrain)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs cannot be streamed", param="prompt_logprobs")
    params = sampling_params(
        state,
        req,
        max_tokens,
        logprobs=top_k if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        constrain=constrain,
    )
    request_id = new_id("chatcmpl")
    queued = add_requests(state, request_id, [prompt], [params], time.monotonic(), lora)
    return ChatRun(
        request_id,
        queued,
        req.n,
        tools,
        req.logprobs,
        top_k,
        len(prompt.token_ids),
        reasoning=reasoning,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        lora=lora,
    )


def _reasoning_plan(state: ServerState, prompt_ids: Sequence[int]) -> ReasoningPlan | None:
    if state.reasoning_parser is None:
        return None
    tail = state.engine.tokenizer.decode(
        list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False
    )
    return reasoning_plan(state.reasoning_parser, tail)
