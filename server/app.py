"""The FastAPI app: routes, API-key check, lifespan of the engine thread.

`build_app(engine, ...)` serves a model through any engine client: a decoder-only model's text
routes, or a Whisper model's /v1/audio/transcriptions; `server.api_server.run_server` wraps it
in uvicorn for the CLI.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.engine.frontend.client import EngineClient, check_core_index
from pagedserve.engine.models.whisper_config import (
    WhisperConfig,
    WhisperDecoding,
    whisper_config_of,
)
from pagedserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.server.anthropic.serving_messages import count_tokens, create_message
from pagedserve.server.audio.serving_transcriptions import (
    TranscriptionState,
    audio_seconds,
    create_transcription,
)
from pagedserve.server.dashboard import dashboard_html
from pagedserve.server.embeddings.serving_embeddings import add_embedding_routes
from pagedserve.server.errors import (
    APIError,
    BodySizeLimit,
    ErrorMappingRoute,
    error_response,
    install_error_handlers,
)
from pagedserve.server.limits import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedserve.server.lora.serving_lora import (
    LoRAAdapters,
    adapter_card,
    add_lora_routes,
    parse_lora_module,
)
from pagedserve.server.metrics.pagedserve_metrics import Metrics
from pagedserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.server.openai.protocol_responses import ResponsesRequest
from pagedserve.server.openai.serving_chat import chat_prompt_ids, create_chat_completion
from pagedserve.server.openai.serving_completions import create_completion
from pagedserve.server.openai.serving_responses import ResponsesAPI
from pagedserve.server.serving_common import ServerState, check_model, check_model_name


def version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_app(
    engine: EngineClient,
    served_model_names: tuple[str, ...] | list[str],
    model_root: str,
    api_key: str | None = None,
    manage_engine: bool = True,
    request_timeout: float | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_n: int = DEFAULT_MAX_N,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    allowed_origins: list[str] | None = None,
    lora_modules: Sequence[str] = (),
) -> FastAPI:
    """An app serving `engine`. With manage_engine, the app starts the engine loop on a
    background thread at startup and stops it at shutdown; otherwise the caller runs the loop
    (`pagedserve serve` runs it on the main thread). `lora_modules`: LoRA adapters to serve
    from the start, `name=path` each (server/lora/serving_lora.py; ValueError for one that does not
    fit the model)."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    loras = LoRAAdapters(engine, tuple(served_model_names))
    for module in lora_modules:
        try:
            loras.load(*parse_lora_module(module))
        except APIError as e:  # (a repeated name): a start-up error, not an HTTP answer
            raise ValueError(f"--lora-modules {module!r}: {e}") from None
    state = ServerState(
        engine=engine,
        metrics=Metrics(
            lambda: engine.stats,
            read_core_stats=lambda: engine.core_stats,
            core_pids=lambda: engine.core_pids,
            model_name=served_model_names[0],
        ),
        served_model_names=tuple(served_model_names),
        model_root=model_root,
        api_key=api_key or None,
        request_timeout=request_timeout,
        max_n=max_n,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        loras=loras,
    )
    app, v1, check_api_key = _new_app(
        engine, state.api_key, max_request_body_bytes, allowed_origins, manage_engine
    )
    app.state.server = state
    _add_common_routes(
        app, v1, engine, state.served_model_names, model_root, engine.max_model_len,
        state.metrics, loras,
    )  # fmt: skip
    add_lora_routes(v1, loras)

    whisper = whisper_config_of(model_root)
    if engine.inputs.pooling is not None:  # an embedding model (--task embed, or auto)
        add_embedding_routes(v1, state)
    elif whisper is None:
        _add_text_routes(v1, state)
    else:
        _add_transcription_routes(v1, state, whisper, WhisperDecoding.of(model_root))

    @v1.get("/kv")
    async def kv_map(engine_index: int = Query(0, alias="engine")) -> Response:
        """The live block map (engine/core/engine_core.py `EngineCore.kv_map`) of engine core
        `?engine=i` (default 0; several with --data-parallel-size); /dashboard polls it."""
        try:
            check_core_index(engine_index, engine.num_cores)
        except ValueError as e:
            raise APIError(400, str(e), param="engine") from None
        try:
            body = await engine.kv_map(engine=engine_index)
        except TimeoutError:
            raise APIError(
                503, "the engine core did not answer within 10 s", code="engine_busy"
            ) from None
        return Response(body, media_type="application/json")

    app.include_router(v1)

    async def check_dashboard_key(request: Request) -> None:
        # A browser cannot send a header when it opens a page: the key may come as
        # ?api_key=..., which the page then sends to /v1/kv as its bearer token.
        if state.api_key is None:
            return
        key = request.query_params.get("api_key")
        if key is not None and hmac.compare_digest(key.encode(), state.api_key.encode()):
            return
        try:
            await check_api_key(request)
        except APIError:
            raise APIError(
                401,
                "Incorrect or missing API key: open /dashboard?api_key=<key>, or send "
                "'Authorization: Bearer <key>'",
                code="invalid_api_key",
            ) from None

    @app.get("/dashboard", dependencies=[Depends(check_dashboard_key)])
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        tokenizer = engine.tokenizer
        if body.messages is not None:
            tokens = chat_prompt_ids(state, body)
        else:
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        result = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(state, body.model)
        tokenizer = engine.tokenizer
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def _add_text_routes(v1: APIRouter, state: ServerState) -> None:
    """A decoder-only model: completions and chat; it transcribes nothing."""

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(state, body, raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(state, body, raw_request)

    @v1.post("/messages")
    async def messages(body: MessagesRequest, raw_request: Request) -> Response:
        return await create_message(state, body, raw_request)

    @v1.post("/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict:
        return count_tokens(state, body)

    responses = ResponsesAPI(state)  # server/openai/serving_responses.py, with its store

    @v1.post("/responses")
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(body, raw_request)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return responses.get(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    _refuse(
        v1,
        ["/audio/transcriptions"],
        f"model {state.model_name!r} does not transcribe audio: serve a Whisper model (a "
        "WhisperForConditionalGeneration folder) for /v1/audio/transcriptions",
    )
    _refuse(
        v1,
        ["/embeddings"],
        f"model {state.model_name!r} generates text: it serves no embeddings (serve an "
        "embedding model, or this one with --task embed)",
    )


def _add_transcription_routes(
    v1: APIRouter, state: ServerState, whisper: WhisperConfig, decoding: WhisperDecoding
) -> None:
    """A Whisper model: /v1/audio/transcriptions (server/audio/serving_transcriptions.py); it
    continues no text."""
    transcription = TranscriptionState(state, whisper, decoding, audio_seconds(state.metrics))

    @v1.post("/audio/transcriptions")
    async def transcriptions(raw_request: Request) -> Response:
        return await create_transcription(transcription, raw_request)

    _refuse(
        v1,
        ["/completions", "/chat/completions", "/responses", "/messages"],
        f"model {state.model_name!r} is a Whisper model: it serves /v1/audio/transcriptions only",
    )


def _refuse(v1: APIRouter, paths: list[str], message: str) -> None:
    """POST `paths`: a 400 saying what this model does not do."""

    async def not_supported() -> Response:
        raise APIError(400, message, code="model_not_supported")

    for path in paths:
        v1.post(path)(not_supported)


def _new_app(
    engine: EngineClient,
    api_key: str | None,
    max_request_body_bytes: int,
    allowed_origins: list[str] | None,
    manage_engine: bool,
) -> tuple[FastAPI, APIRouter, Callable[[Request], Awaitable[None]]]:
    """(the app, its /v1 router, the API-key check): error handling, the body-size limit, CORS
    and the engine's lifespan. With manage_engine, the app starts the engine loop on a
    background thread at startup and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started_here = manage_engine and not engine.is_running
        if started_here:
            engine.start()
        try:
            yield
        finally:
            if started_here:
                engine.shutdown()

    app = FastAPI(title="pagedserve", version=version(), lifespan=lifespan)
    app.router.route_class = ErrorMappingRoute
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if allowed_origins:  # CORS stays off (browsers refuse cross-origin calls) unless asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        """The key as a bearer token (OpenAI's clients) or in `x-api-key` (Anthropic's)."""
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest takes time independent of where the strings differ.
        if scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            return
        x_api_key = request.headers.get("x-api-key")
        if x_api_key is not None and hmac.compare_digest(
            x_api_key.strip().encode(), api_key.encode()
        ):
            return
        raise APIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'",
            code="invalid_api_key",
        )

    v1 = APIRouter(
        prefix="/v1", dependencies=[Depends(check_api_key)], route_class=ErrorMappingRoute
    )
    return app, v1, check_api_key


def _add_common_routes(
    app: FastAPI,
    v1: APIRouter,
    engine: EngineClient,
    served_model_names: tuple[str, ...],
    model_root: str,
    max_model_len: int,
    metrics: Metrics,
    loras: LoRAAdapters,
) -> None:
    """/v1/models (the LoRA adapters too, each with its base model as parent), /health,
    /version, /metrics and /."""
    created_at = int(time.time())

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created_at,
            "owned_by": "pagedserve",
            "root": model_root,
            "parent": None,
            "max_model_len": max_model_len,
        }

    def adapter_cards() -> list[dict]:
        base = model_card(served_model_names[0])
        return [
            adapter_card(base, name, path, served_model_names[0]) for name, path in loras.cards()
        ]

    @v1.get("/models")
    async def list_models() -> dict:
        cards = [model_card(n) for n in served_model_names] + adapter_cards()
        return {"object": "list", "data": cards}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        adapter = next((card for card in adapter_cards() if card["id"] == model_id), None)
        if adapter is not None:
            return adapter
        check_model_name([*served_model_names, *loras.names()], model_id)
        return model_card(model_id)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(
                APIError(503, f"engine is not running: {engine.error!r}", code="engine_dead")
            )
        if engine.draining:  # load balancers stop sending requests here
            return error_response(
                APIError(503, "the server is shutting down", code="shutting_down")
            )
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def root() -> JSONResponse:
        return JSONResponse({"name": "pagedserve", "version": version(), "docs": "/docs"})
