"""What the completions and chat handlers share on the way to the engine and back: the context
length check, SamplingParams from the request's fields (a bad value is a 400 naming the field),
and logprobs as JSON (which has no -inf)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagedserve.engine.frontend.outputs import Logprob
from pagedserve.scheduler import SamplingParams, StructuredOutputs
from pagedserve.server.errors import APIError
from pagedserve.server.openai.protocol import SamplingFields
from pagedserve.server.openai.structured_outputs import structured_outputs_of
from pagedserve.server.serving_common import ServerState

# JSON has no -inf; a token the model rules out entirely gets this logprob instead (as vLLM does).
MIN_LOGPROB = -9999.0


def check_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The number of tokens to generate: the request's, or all the room left in the context.

    The prompt itself was checked (`process_prompt`) before this."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:  # SamplingParams checks the rest (max_tokens >= 1)
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return max_tokens


def sampling_params(
    state: ServerState,
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    best_of: int | None = None,
    constrain: StructuredOutputs | None = None,
) -> SamplingParams:
    """SamplingParams from the request fields; an invalid value is a 400 naming the field.
    `constrain` replaces the constraint the request's own fields ask for (tool calls)."""
    if req.stream_options is not None and not req.stream:
        # As the OpenAI API and vLLM: the options only mean something for a stream.
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    for name, value in (("n", req.n), ("best_of", best_of)):
        if isinstance(value, int) and value > state.max_n:
            raise APIError(
                400,
                f"{name} must be at most {state.max_n} on this server (--max-n), got {value}",
                param=name,
            )
    if req.stream and req.use_beam_search:
        raise APIError(
            400, "use_beam_search cannot be streamed: set stream to false", param="stream"
        )
    if req.stream and isinstance(best_of, int) and best_of != req.n:
        # The n best are known only when every sample has finished.
        raise APIError(
            400, f"best_of ({best_of}) other than n ({req.n}) cannot be streamed", param="stream"
        )
    fields: dict[str, Any] = {
        "structured_outputs": structured_outputs_of(req) if constrain is None else constrain,
        "n": req.n,
        "max_tokens": max_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "seed": req.seed,
        "logprobs": logprobs,
        "best_of": best_of,
        "use_beam_search": req.use_beam_search,
        "length_penalty": req.length_penalty,
        # Handlers consume what is new each step; `final_outputs` folds it into whole outputs.
        "output_kind": "delta",
    }
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.stop is not None:
        fields["stop"] = req.stop
    if req.stop_token_ids is not None:
        fields["stop_token_ids"] = req.stop_token_ids
    fields.update(token_rule_fields(req))
    try:
        params = SamplingParams(**fields)
        params.check_token_ids(state.engine.vocab_size)
        return params
    except ValueError as e:
        message = str(e)
        first_word = message.split(" ", 1)[0]
        raise APIError(400, message, param=first_word if first_word in fields else None) from e


def token_rule_fields(req: SamplingFields) -> dict[str, Any]:
    """SamplingParams' min_tokens, logit_bias (its keys are token ids as strings in JSON),
    bad_words and allowed_token_ids from the request (400 naming the field for a bad key)."""
    fields: dict[str, Any] = {}
    if req.min_tokens:
        fields["min_tokens"] = req.min_tokens
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            bias[token_id] = value
        fields["logit_bias"] = bias
    if req.bad_words:
        fields["bad_words"] = req.bad_words
    if req.allowed_token_ids is not None:
        fields["allowed_token_ids"] = req.allowed_token_ids
    return fields


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def prompt_logprobs_json(
    entries: Sequence[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first: nothing predicts it) or
    {token id: {"logprob", "rank", "decoded_token"}} for the token and the top k."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": safe_logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]
