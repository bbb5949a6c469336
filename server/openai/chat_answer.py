"""A chat run's answer: the `chat.completion` object once every choice has finished, or the
`chat.completion.chunk`s as its tokens come, whose first chunk per choice carries the role. The
Responses and Messages APIs reshape the same answer (server/openai/responses_output.py,
server/anthropic/messages_stream.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request

from pagedserve.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.scheduler import LoRARequest
from pagedserve.server.openai.reasoning import ReasoningPlan, ReasoningStream
from pagedserve.server.openai.sampling import prompt_logprobs_json, safe_logprob
from pagedserve.server.openai.tool_calls import ToolCallStream, ToolPlan
from pagedserve.server.serving_common import (
    ServerState,
    accumulate,
    created,
    final_outputs,
    iterate_all,
    usage,
)

E = TypeVar("E")


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


async def chat_body(state: ServerState, run: ChatRun, raw_request: Request) -> dict[str, Any]:
    """The `chat.completion` object of a run, once every choice has finished."""
    (final,) = await final_outputs(run.queued, raw_request, state.request_timeout)
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


class DeltaSink(Protocol[E]):
    """What the chunks of a chat run are reshaped into (the Responses API's output items, the
    Messages API's content blocks); each call returns the events (or frames) it makes."""

    def reasoning(self, text: str) -> list[E]: ...

    def text(self, text: str) -> list[E]: ...

    def tool_call(self, fragment: dict[str, Any]) -> list[E]: ...


def delta_events(sink: DeltaSink[E], delta: dict[str, Any]) -> list[E]:
    """What `sink` makes of one choice's `delta` in a chunk: its reasoning, then its text, then
    its tool call fragments."""
    events: list[E] = []
    if delta.get("reasoning_content"):
        events += sink.reasoning(delta["reasoning_content"])
    if delta.get("content"):
        events += sink.text(delta["content"])
    for fragment in delta.get("tool_calls") or ():
        events += sink.tool_call(fragment)
    return events
