"""What the handlers of every API share: the server's state, the model check, queueing engine
requests and merging the streams of a multi-prompt request, the request deadline, disconnect
handling, SSE framing. (Sampling parameters: server/openai/sampling.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from pagedserve.engine.frontend.client import EngineClient, RequestStream
from pagedserve.engine.frontend.inputs import Prompt
from pagedserve.engine.frontend.outputs import RequestOutput
from pagedserve.scheduler import LoRARequest, SamplingParams
from pagedserve.server.errors import APIError, as_api_error, error_body
from pagedserve.server.limits import DEFAULT_MAX_N
from pagedserve.server.lora.serving_lora import LoRAAdapters
from pagedserve.server.metrics.pagedserve_metrics import Metrics, RequestMetrics

logger = logging.getLogger("pagedserve")

T = TypeVar("T")


@dataclass(frozen=True)
class ServerState:
    """What every handler needs; one per app (kept on app.state)."""

    engine: EngineClient
    metrics: Metrics
    served_model_names: tuple[str, ...]
    model_root: str
    api_key: str | None = None
    request_timeout: float | None = None  # seconds a request may take (--request-timeout)
    max_n: int = DEFAULT_MAX_N  # samples per prompt (--max-n)
    tool_call_parser: str = "auto"  # how tool calls are read from text (--tool-call-parser)
    reasoning_parser: str | None = None  # how <think> parts are read (--reasoning-parser)
    loras: LoRAAdapters | None = None  # the LoRA adapters served by name (server/lora/)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def answering_model(self, lora: LoRARequest | None) -> str:
        """The `model` of an answer: the adapter's name, or the base model's."""
        return self.model_name if lora is None else lora.lora_name


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter `model` names, None for the base model (or no model given); APIError 404
    for a name that is neither."""
    if model is None or model in state.served_model_names:
        return None
    lora = state.loras.get(model) if state.loras is not None else None
    if lora is None:
        names = [*state.served_model_names, *(state.loras.names() if state.loras else ())]
        check_model_name(names, model)
    return lora


def check_model_name(served_model_names: Sequence[str], model: str | None) -> None:
    """APIError 404 unless `model` (when given) is one of the names served."""
    if model is not None and model not in served_model_names:
        raise APIError(
            404,
            f"The model `{model}` does not exist. Available models: "
            f"{', '.join(served_model_names)}",
            param="model",
            code="model_not_found",
        )


def warn_unknown_fields(body: Any, endpoint: str) -> None:
    unknown = body.unknown_fields()
    if unknown:
        logger.warning("%s: ignoring unknown fields %s", endpoint, ", ".join(unknown))


def add_requests(
    state: ServerState,
    request_id: str,
    prompts: Sequence[Prompt],
    params: Sequence[SamplingParams],
    arrival: float,
    lora: LoRARequest | None = None,
) -> list[tuple[RequestStream, RequestMetrics]]:
    """Queue one engine request per prompt, with the adapter `lora` (None: the base model); all
    or nothing (a failure aborts the ones queued)."""
    queued: list[tuple[RequestStream, RequestMetrics]] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            stream = state.engine.add_request(rid, prompt, p, lora_request=lora)
            metrics = state.metrics.track(len(prompt.token_ids), arrival, lora)
            queued.append((stream, metrics))
    except BaseException:
        for stream, _ in queued:
            stream.abort()
        raise
    return queued


class Deadline:
    """`await deadline(awaitable)`: its result, or APIError 504 once `timeout` seconds (the
    server's --request-timeout; None: no limit) have passed since the Deadline was made."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._at = None if timeout is None else self._loop.time() + timeout

    async def __call__(self, awaitable: Awaitable[T]) -> T:
        if self._at is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, self._at - self._loop.time()))
        except TimeoutError:
            raise APIError(
                504,
                f"the request did not finish within the server's --request-timeout of "
                f"{self.timeout:g} s",
                code="request_timeout",
            ) from None


async def iterate_all(
    queued: Sequence[tuple[RequestStream, RequestMetrics]],
    timeout: float | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index. Leaving
    early, a failure in one, or `timeout` seconds passing (APIError 504) aborts all of them.

    The deadline bounds each wait for the next output, never the consumer's own work between
    outputs (a timeout spanning the generator's yields would cancel whatever the consumer
    awaits then, e.g. sending a chunk)."""
    within_deadline = Deadline(timeout)
    merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream, tracker: RequestMetrics) -> None:
        try:
            async for output in stream:
                tracker.update(output)
                merged.put_nowait((index, _checked(output)))
            merged.put_nowait(None)
        except BaseException as e:  # noqa: B036 - re-raised by the consumer below
            merged.put_nowait(e)

    tasks = []
    try:
        if len(queued) == 1:  # the common case, without a task in between
            stream, tracker = queued[0]
            outputs = aiter(stream)
            while True:
                try:
                    output = await within_deadline(anext(outputs))
                except StopAsyncIteration:
                    return
                tracker.update(output)
                yield 0, _checked(output)
        tasks = [asyncio.create_task(pump(i, s, t)) for i, (s, t) in enumerate(queued)]
        remaining = len(tasks)
        while remaining:
            item = await within_deadline(merged.get())
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream, _ in queued:
            stream.abort()


def _checked(output: RequestOutput) -> RequestOutput:
    """The output, unless the engine failed its request: then the client's 500 (a stream's final
    error event), the other requests going on."""
    if output.error is not None:
        raise APIError(500, f"the request failed: {output.error}", code="request_failed")
    return output


async def final_outputs(
    queued: Sequence[tuple[RequestStream, RequestMetrics]],
    raw_request: Request,
    timeout: float | None = None,
) -> list[RequestOutput]:
    """The whole output of every request, in prompt order, folded from its deltas; a client
    that disconnects first cancels them (`unless_disconnected`)."""

    async def fold() -> list[RequestOutput]:
        wholes: dict[int, RequestOutput] = {}
        async for index, output in iterate_all(queued, timeout):
            accumulate(wholes, index, output)
        return [wholes[i] for i in range(len(queued))]

    return await unless_disconnected(raw_request, fold())


def accumulate(wholes: dict[int, RequestOutput], index: int, delta: RequestOutput) -> None:
    """Fold a delta output into `wholes[index]` (the first one is kept as it is)."""
    whole = wholes.get(index)
    if whole is None:
        wholes[index] = delta
    else:
        whole.add(delta)


async def unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client disconnects first (which aborts its engine
    requests and frees their blocks). Streaming responses get this from Starlette already."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    err = as_api_error(exc)
    return sse(error_body(err.message, err.type, err.param, err.code))


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """`events` as server-sent events, then [DONE]. The status line has gone out with the first
    byte, so a failure (the request's, or the engine's) becomes an error event before [DONE];
    leaving early closes `events` at once, aborting its requests, not at GC."""
    try:
        async with aclosing(events):
            async for event in events:
                yield sse(event)
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE


def created() -> int:
    return int(time.time())
