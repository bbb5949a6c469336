"""POST /v1/completions: the OpenAI `text_completion` API, streamed or not.

A request may carry several prompts (strings or token-id lists); each becomes one engine request
with `n` samples. Choice `index` = prompt_index * n + sample_index, as in the OpenAI API.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.frontend.inputs import Prompt
from pagedserve.engine.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.scheduler import LoRARequest
from pagedserve.server.errors import APIError
from pagedserve.server.openai.fill_in_middle import fim_prompts
from pagedserve.server.openai.protocol import CompletionRequest
from pagedserve.server.openai.sampling import check_max_tokens, safe_logprob, sampling_params
from pagedserve.server.serving_common import (
    ServerState,
    accumulate,
    add_requests,
    check_model,
    created,
    final_outputs,
    iterate_all,
    new_id,
    sse_stream,
    usage,
    warn_unknown_fields,
)


async def create_completion(
    state: ServerState, req: CompletionRequest, raw_request: Request
) -> JSONResponse | StreamingResponse:
    lora = check_model(state, req.model)
    warn_unknown_fields(req, "/v1/completions")
    if req.suffix is not None and req.echo:
        # As OpenAI: the echoed prompt would have to hold the suffix too.
        raise APIError(400, "echo cannot be combined with suffix", param="echo")
    prompts = _prompts(state, req.prompt, req.suffix)
    # max_tokens=0 with echo returns the prompt (and its logprobs) only, the way evaluation
    # harnesses score a text: the engine generates one token that is then left out.
    echo_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
    params = []
    for prompt in prompts:
        max_tokens = 1 if echo_only else req.max_tokens
        max_tokens = check_max_tokens(max_tokens, len(prompt.token_ids), state.engine.max_model_len)
        params.append(
            sampling_params(
                state,
                req,
                max_tokens,
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                best_of=req.best_of,
            )
        )
    arrival = time.monotonic()
    request_id = new_id("cmpl")
    queued = add_requests(state, request_id, prompts, params, arrival, lora)
    writer = _ChoiceWriter(state, req, prompts, echo_only)
    if req.stream:
        return StreamingResponse(
            sse_stream(_chunks(state, req, request_id, queued, writer, lora)),
            media_type="text/event-stream",
        )
    finals = await final_outputs(queued, raw_request, state.request_timeout)
    choices = []
    for prompt_index, output in enumerate(finals):
        for sample in output.outputs:
            choices.append(writer.full_choice(prompt_index, output, sample))
    counts = usage(finals)
    if echo_only:
        counts["completion_tokens"] = 0
        counts["total_tokens"] = counts["prompt_tokens"]
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created(),
            "model": state.answering_model(lora),
            "choices": choices,
            "usage": counts,
        }
    )


def _prompts(state: ServerState, prompt: Any, suffix: str | None = None) -> list[Prompt]:
    """The request's prompts, tokenized and checked (with a `suffix`: as fill-in-the-middle
    prompts). `prompt` has passed pydantic: a string, a list of strings, a list of token ids or
    a list of token-id lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if suffix is not None:
        items = fim_prompts(state.engine.tokenizer, state.model_name, items, suffix)
    return [state.engine.process_prompt(item) for item in items]


class _ChoiceWriter:
    """Builds choices (whole, or as stream deltas) in the OpenAI completion shape."""

    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest,
        prompts: Sequence[Prompt],
        echo_only: bool,
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        tokenizer = state.engine.tokenizer
        # What `echo` prepends: the text, or the token ids decoded (checked in range already).
        self.echo_texts = (
            [p.text if p.text is not None else tokenizer.decode(p.token_ids) for p in prompts]
            if req.echo
            else []
        )
        self.echo_only = echo_only
        # Per streamed choice index: the text offset its next logprobs start at.
        self._lp_offsets: dict[int, int] = {}
        self._finished: set[int] = set()

    def index(self, prompt_index: int, sample: CompletionOutput) -> int:
        return prompt_index * self.req.n + sample.index

    def full_choice(
        self, prompt_index: int, output: RequestOutput, sample: CompletionOutput
    ) -> dict[str, Any]:
        prompt = self.prompts[prompt_index]
        text, logprobs = "", None
        lp = _LogprobWriter(self.state) if self.req.logprobs is not None else None
        if self.req.echo:
            text = self.echo_texts[prompt_index]
            if lp is not None:
                lp.add(prompt.token_ids, output.prompt_logprobs)
        if not self.echo_only:
            text += sample.text
            if lp is not None and sample.logprobs is not None:
                lp.add(sample.token_ids, sample.logprobs)
        if lp is not None:
            logprobs = lp.result()
        return {
            "index": self.index(prompt_index, sample),
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if self.echo_only else sample.finish_reason,
            "stop_reason": None if self.echo_only else sample.stop_reason,
        }

    def delta_choices(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The choices of this delta output with something to send (one chunk each)."""
        prompt = self.prompts[prompt_index]
        choices = []
        for sample in output.outputs:
            index = self.index(prompt_index, sample)
            if index in self._finished:
                continue
            first = index not in self._lp_offsets
            lp_offset = self._lp_offsets.setdefault(index, 0)
            lp = _LogprobWriter(self.state, lp_offset) if self.req.logprobs is not None else None
            text = ""
            if first and self.req.echo:
                text = self.echo_texts[prompt_index]
                if lp is not None:
                    lp.add(prompt.token_ids, output.prompt_logprobs)
            new_tokens = sample.token_ids
            if not self.echo_only:
                text += sample.text
                if lp is not None and sample.logprobs is not None:
                    lp.add(new_tokens, sample.logprobs)
            finish = sample.finish_reason if sample.finished else None
            if self.echo_only and finish is not None:
                finish = "length"
            if not text and finish is None and not (lp is not None and new_tokens):
                continue
            self._lp_offsets[index] = lp.offset if lp is not None else 0
            if finish is not None:
                self._finished.add(index)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": lp.result() if lp is not None else None,
                    "finish_reason": finish,
                    "stop_reason": None if self.echo_only else sample.stop_reason,
                }
            )
        return choices


class _LogprobWriter:
    """The legacy completions logprobs object: parallel lists plus text offsets."""

    def __init__(self, state: ServerState, offset: int = 0) -> None:
        self.state = state
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, Logprob] | None] | None,
    ) -> None:
        tokenizer = self.state.engine.tokenizer
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            if entry is None or token_id not in entry:
                token = tokenizer.decode([token_id])
                self.tokens.append(token)
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
            else:
                token = entry[token_id].decoded_token
                self.tokens.append(token)
                self.token_logprobs.append(safe_logprob(entry[token_id].logprob))
                ranked = sorted(entry.values(), key=lambda lp: lp.rank)
                self.top_logprobs.append(
                    {lp.decoded_token: safe_logprob(lp.logprob) for lp in ranked}
                )
            self.text_offset.append(self.offset)
            self.offset += len(token)

    def result(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


async def _chunks(
    state: ServerState,
    req: CompletionRequest,
    request_id: str,
    queued,
    writer: _ChoiceWriter,
    lora: LoRARequest | None,
) -> AsyncIterator[dict[str, Any]]:
    """The `text_completion` chunks as the tokens come (a failure raises)."""
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": created(),
        "model": state.answering_model(lora),
    }
    wholes: dict[int, RequestOutput] = {}
    async for prompt_index, output in iterate_all(queued, state.request_timeout):
        for choice in writer.delta_choices(prompt_index, output):
            yield {**base, "choices": [choice]}
        accumulate(wholes, prompt_index, output)
    if req.stream_options is not None and req.stream_options.include_usage:
        counts = usage([wholes[i] for i in sorted(wholes)])
        if writer.echo_only:
            counts["completion_tokens"] = 0
            counts["total_tokens"] = counts["prompt_tokens"]
        yield {**base, "choices": [], "usage": counts}
