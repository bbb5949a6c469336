"""POST /v1/chat/completions: messages rendered with the model's chat template, answered in the
`chat.completion` shape, or streamed as `chat.completion.chunk`s whose first chunk per choice
carries the role."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.engine.models.tokenizer import apply_chat_template
from pagedserve.scheduler import LoRARequest
from pagedserve.scheduler.sampling_params import MAX_LOGPROBS
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest, TokenizeRequest
from pagedserve.server.reasoning import (
    PROMPT_TAIL_TOKENS,
    ReasoningPlan,
    ReasoningStream,
    reasoning_plan,
)
from pagedserve.server.serving_common import (
    SSE_DONE,
    ServerState,
    accumulate,
    add_requests,
    check_max_tokens,
    check_model,
    created,
    final_outputs,
    iterate_all,
    new_id,
    prompt_logprobs_json,
    safe_logprob,
    sampling_params,
    sse,
    sse_error,
    unless_disconnected,
    usage,
    warn_unknown_fields,
)
from pagedserve.server.structured_outputs import structured_outputs_of
from pagedserve.server.tool_calls import ToolCallStream, ToolPlan, plan_tools


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


@dataclass(frozen=True)
class ChatRun:
    """A chat request queued on the engine: what its answer, whole or streamed, is made of.
    The Responses and Messages APIs run their conversations as one and reshape its output."""

    request_id: str
    queued: list
    n: int
    tools: ToolPlan | None
    want_logprobs: bool
    top_k: int  # top_logprobs per token
    prompt_tokens: int = 0  # the rendered conversation's (the Messages API's message_start)
    reasoning: ReasoningPlan | None = None  # --reasoning-parser: how choices split off <think>
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs: in the body, whole answers only
    lora: LoRARequest | None = None  # the adapter named in `model` (None: the base model)

    def base(self, state: ServerState) -> dict[str, Any]:
        model = state.answering_model(self.lora)
        return {"id": self.request_id, "created": created(), "model": model}


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    warn_unknown_fields(req, "/v1/chat/completions")
    run = start_chat(state, req)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(
            _sse(chat_chunks(state, run, include_usage)), media_type="text/event-stream"
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


async def chat_body(state: ServerState, run: ChatRun, raw_request: Request) -> dict[str, Any]:
    """The `chat.completion` object of a run, once every choice has finished."""
    (final,) = await unless_disconnected(
        raw_request, final_outputs(run.queued, state.request_timeout)
    )
    choices = []
    for sample in final.outputs:
        text: str | None = sample.text
        reasoning = None
        if run.reasoning is not None:
            reasoning, text = run.reasoning.parse(sample.text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": reasoning,
        }
        finish = sample.finish_reason
        if run.tools is not None:
            content, calls = run.tools.parse(text) if text is not None else (None, [])
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        choices.append(
            {
                "index": sample.index,
                "message": message,
                "logprobs": _logprobs(sample.token_ids, sample.logprobs, run.top_k)
                if run.want_logprobs
                else None,
                "finish_reason": finish,
                "stop_reason": sample.stop_reason,
            }
        )
    return {
        **run.base(state),
        "object": "chat.completion",
        "choices": choices,
        "usage": usage([final]),
        **(
            {"prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs)}
            if run.want_prompt_logprobs
            else {}
        ),
    }


def _logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]] | None, top_k: int
) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries or (), strict=False):
        chosen = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": safe_logprob(chosen.logprob),
                "bytes": list(chosen.decoded_token.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token,
                        "logprob": safe_logprob(lp.logprob),
                        "bytes": list(lp.decoded_token.encode("utf-8")),
                    }
                    for lp in top
                ],
            }
        )
    return {"content": content}


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async with aclosing(chunks):  # leaving early aborts the requests at once, not at GC
            async for chunk in chunks:
                yield sse(chunk)
    except Exception as e:  # the request failed or the engine died: tell the client in-band
        yield sse_error(e)
    yield SSE_DONE


async def chat_chunks(
    state: ServerState, run: ChatRun, include_usage: bool = False
) -> AsyncIterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a run as its tokens come (a failure raises);
    leaving early aborts its requests."""
    base = {**run.base(state), "object": "chat.completion.chunk"}
    finished: set[int] = set()  # choice indices
    wholes: dict[int, RequestOutput] = {}

    def chunk(index: int, delta: dict[str, Any], logprobs=None, finish=None, stop=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return {**base, "choices": [choice]}

    # The role comes first, before any token, as OpenAI does.
    for k in range(run.n):
        yield chunk(k, {"role": "assistant", "content": ""})
    calls = {k: ToolCallStream(run.tools) for k in range(run.n)} if run.tools is not None else {}
    thinking = {k: run.reasoning.stream() for k in range(run.n)} if run.reasoning else {}
    outputs = iterate_all(run.queued, state.request_timeout)
    async with aclosing(outputs):
        async for _, output in outputs:
            for sample in output.outputs:
                if thinking:  # the reasoning goes apart; the rest goes on as the sample's text
                    sample, reasoning = _split_reasoning(sample, thinking[sample.index])
                    if reasoning:
                        yield chunk(sample.index, {"reasoning_content": reasoning})
                if run.tools is None:
                    piece = _delta(sample, finished, run.want_logprobs, run.top_k)
                    if piece is not None:
                        yield chunk(sample.index, *piece)
                    continue
                for delta, logprobs, finish, stop in _tool_deltas(
                    sample, calls[sample.index], run.want_logprobs, run.top_k
                ):
                    yield chunk(sample.index, delta, logprobs, finish, stop)
            accumulate(wholes, 0, output)
    if include_usage and wholes:
        yield {**base, "choices": [], "usage": usage([wholes[0]])}


def _split_reasoning(
    sample: CompletionOutput, stream: ReasoningStream
) -> tuple[CompletionOutput, str]:
    """(the sample's delta output with its content as text, its reasoning text)."""
    reasoning, content = stream.feed(sample.text)
    if sample.finished:
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return dataclasses.replace(sample, text=content), reasoning


def _delta(
    sample: CompletionOutput,
    finished: set[int],
    want_logprobs: bool,
    top_k: int,
) -> tuple[dict[str, Any], dict[str, Any] | None, str | None, str | int | None] | None:
    """(delta, logprobs, finish_reason, stop_reason) of a sample's delta output, or None."""
    if sample.index in finished:
        return None
    text = sample.text
    finish = sample.finish_reason if sample.finished else None
    logprobs = None
    if want_logprobs and sample.token_ids and sample.logprobs is not None:
        logprobs = _logprobs(sample.token_ids, sample.logprobs, top_k)
    if not text and finish is None and logprobs is None:
        return None
    if finish is not None:
        finished.add(sample.index)
    delta = {"content": text} if text or finish is None else {}
    return delta, logprobs, finish, sample.stop_reason


def _tool_deltas(
    sample: CompletionOutput, stream: ToolCallStream, want_logprobs: bool, top_k: int
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, str | None, str | int | None]]:
    """The chunks of a sample's delta output when tools may be called: its text goes through
    the choice's ToolCallStream (content, or tool call fragments); the last chunk says
    "tool_calls" when the choice made calls."""
    if want_logprobs and sample.token_ids and sample.logprobs is not None:
        yield {}, _logprobs(sample.token_ids, sample.logprobs, top_k), None, None
    for delta in stream.feed(sample.text):
        yield delta, None, None, None
    if sample.finished:
        tail, called = stream.finish()
        for delta in tail:
            yield delta, None, None, None
        finish = "tool_calls" if called and sample.finish_reason == "stop" else sample.finish_reason
        yield {}, None, finish, sample.stop_reason
