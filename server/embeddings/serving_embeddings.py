"""POST /v1/embeddings: an embedding model's pooled vectors, in OpenAI's shape.

Each input becomes one engine request (`EMBEDDING_PARAMS`: the step that pools its prompt ends
it), batched by the scheduler with the others; the engine's pooling config (engine/models/
bert_config.py `PoolingConfig`) says how the vector is made. `dimensions` cuts a Matryoshka
model's vector (then normalises it again, when the model normalises); `encoding_format`
"base64" sends each vector's little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.frontend.inputs import EMBEDDING_PARAMS, Prompt
from pagedserve.server.errors import APIError
from pagedserve.server.request_body import RequestBody
from pagedserve.server.serving_common import (
    ServerState,
    add_requests,
    check_model,
    final_outputs,
    new_id,
    warn_unknown_fields,
)

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(RequestBody):
    # A text, texts, token ids or lists of token ids (OpenAI's four shapes): checked here, the
    # field named, rather than by pydantic.
    input: Any = None
    model: str | None = None
    encoding_format: Any = "float"
    dimensions: Any = None
    user: str | None = None


# What an embedding server refuses: it generates no text.
GENERATION_PATHS = ("/completions", "/chat/completions", "/responses", "/messages")


def add_embedding_routes(v1: APIRouter, state: ServerState) -> None:
    """An embedding model: /v1/embeddings, and a 400 for the generation routes."""

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await create_embedding(state, body, raw_request)

    async def not_supported() -> Response:
        raise APIError(
            400,
            f"model {state.model_name!r} is an embedding model: it serves /v1/embeddings only",
            code="model_not_supported",
        )

    for path in GENERATION_PATHS:
        v1.post(path)(not_supported)


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids or a list of such
    lists -> one entry per embedding."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return value
        if all(_is_id(x) for x in value):
            return [value]
        if all(isinstance(x, list) and all(_is_id(t) for t in x) for x in value):
            return value
    if isinstance(value, list) and not value:
        raise APIError(400, "input is empty: give at least one text or token list", param="input")
    raise APIError(
        400,
        "input must be a string, a list of strings, a list of token ids or a list of token-id "
        "lists",
        param="input",
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dimensions(state: ServerState, value: Any) -> int | None:
    if value is None:
        return None
    inputs = state.engine.inputs
    pooling, size = inputs.pooling, inputs.hidden_size
    if not _is_id(value) or not pooling.allows_dimensions(value, size):
        sizes = (
            f"1 to {size}"
            if pooling.any_dimensions
            else ", ".join(map(str, sorted({*pooling.matryoshka_dimensions, size})))
        )
        declared = pooling.any_dimensions or pooling.matryoshka_dimensions
        why = "" if declared else " (it declares no Matryoshka sizes: only its full size)"
        raise APIError(
            400,
            f"dimensions {value!r} is not supported by model {state.model_name!r}{why}; "
            f"supported: {sizes}",
            param="dimensions",
        )
    return value


def embedding_vector(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The vector as sent: cut to `dimensions` (Matryoshka), then L2-normalised again when the
    model normalises its vectors."""
    if dimensions is None or dimensions == len(vector):
        return vector
    cut = vector[:dimensions].astype(np.float32)
    if normalize:
        cut = cut / max(float(np.linalg.norm(cut)), 1e-12)
    return cut


async def create_embedding(
    state: ServerState, body: EmbeddingRequest, raw_request: Request
) -> Response:
    check_model(state, body.model)
    warn_unknown_fields(body, "/v1/embeddings")
    if body.encoding_format not in ENCODING_FORMATS:
        raise APIError(
            400,
            f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got "
            f"{body.encoding_format!r}",
            param="encoding_format",
        )
    dimensions = _dimensions(state, body.dimensions)
    inputs = state.engine.inputs
    prompts: list[Prompt] = []
    texts = _inputs(body.input)
    for i, text in enumerate(texts):
        try:
            prompts.append(inputs.process_embedding_prompt(text))
        except ValueError as e:
            where = "" if len(texts) == 1 else f"input[{i}]: "
            raise APIError(400, f"{where}{e}", param="input") from None
    arrival = time.monotonic()
    queued = add_requests(
        state, new_id("embd"), prompts, [EMBEDDING_PARAMS] * len(prompts), arrival
    )
    outputs = await final_outputs(queued, raw_request, state.request_timeout)
    data = []
    for index, output in enumerate(outputs):
        vector = embedding_vector(output.embedding, dimensions, inputs.pooling.normalize)
        if body.encoding_format == "base64":
            encoded: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            encoded = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    num_tokens = sum(len(p.token_ids) for p in prompts)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": body.model or state.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )
