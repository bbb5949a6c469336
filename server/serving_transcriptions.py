"""`POST /v1/audio/transcriptions`: OpenAI's multipart form in, the transcription out
in the response format asked for, or streamed as server-sent text deltas.

The form: `file` (WAV, FLAC, MP3 or OGG; engine/frontend/audio.py), `model`, `language` (ISO-639-1
code or English name; default en), `prompt` (text the model takes as what came before),
`response_format` (json, text, verbose_json, srt, vtt), `temperature` (0: greedy), `stream`,
`timestamp_granularities[]` (segment; verbose_json only). The audio is cut into 30-second
windows that all run in the continuous batch at once (engine/frontend/whisper_service.py); their
texts join in order. A stream sends each window's text as it is decoded, in window order:
`{"type": "transcript.text.delta", "delta": ...}` events, then one `transcript.text.done` with
the whole text and the token usage, then `[DONE]`, the events OpenAI's client reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import Counter
from starlette.datastructures import UploadFile

from pagedserve.engine.frontend.audio import decode_audio, duration, windows
from pagedserve.engine.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import Metrics
from pagedserve.server.serving_common import (
    SSE_DONE,
    Deadline,
    check_model_name,
    new_id,
    sse,
    sse_error,
    unless_disconnected,
)
from pagedserve.server.transcription_formats import (
    RESPONSE_FORMATS,
    format_transcription,
    full_text,
    window_segments,
)

if TYPE_CHECKING:  # the Whisper service loads the model code: imported when one is served
    from pagedserve.engine.frontend.whisper_service import TranscriptionService, TranscriptionStream

logger = logging.getLogger("pagedserve")

FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream",
          "timestamp_granularities[]", "timestamp_granularities", "include[]",
          "chunking_strategy")  # fmt: skip
STREAM_FORMATS = ("json", "text")  # a stream carries text deltas: no segments to time


@dataclass(frozen=True)
class TranscriptionState:
    """What the handler needs; one per app (kept on app.state)."""

    service: TranscriptionService
    metrics: Metrics
    served_model_names: tuple[str, ...]
    request_timeout: float | None  # seconds a request may take (--request-timeout)
    audio_seconds: Counter


def audio_seconds(metrics: Metrics) -> Counter:
    """The counter of audio transcribed, in `metrics`' registry."""
    return Counter(
        "pagedserve_audio_seconds", "Seconds of audio in finished transcriptions",
        registry=metrics.registry,
    )  # fmt: skip


@dataclass(frozen=True)
class TranscriptionForm:
    upload: UploadFile
    model: str | None
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool


async def read_form(request: Request) -> TranscriptionForm:
    """The fields of the multipart form; APIError 400, naming the field, for what is missing or
    malformed, and for what pagedserve does not do."""
    form = await request.form()
    unknown = sorted(set(form.keys()) - set(FIELDS))
    if unknown:
        logger.warning("/v1/audio/transcriptions: ignoring unknown fields %s", ", ".join(unknown))
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(
            400,
            "send the audio as a file in a multipart/form-data field named `file`",
            param="file",
        )

    def text(name: str) -> str | None:
        value = form.get(name)
        if isinstance(value, UploadFile):
            raise APIError(400, f"`{name}` must be a text field, not a file", param=name)
        return value

    response_format = text("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got "
            f"{response_format!r}",
            param="response_format",
        )
    raw_temperature = text("temperature")
    try:
        temperature = float(raw_temperature) if raw_temperature else 0.0
    except ValueError:
        temperature = math.nan
    if not 0.0 <= temperature <= 1.0:
        raise APIError(
            400, f"temperature must be a number in [0, 1], got {raw_temperature!r}",
            param="temperature",
        )  # fmt: skip
    raw_stream = (text("stream") or "false").strip().lower()
    if raw_stream not in ("true", "false"):
        raise APIError(400, f"stream must be true or false, got {raw_stream!r}", param="stream")
    stream = raw_stream == "true"
    if stream and response_format not in STREAM_FORMATS:
        raise APIError(
            400,
            f"a stream carries text deltas: response_format must be json or text, not "
            f"{response_format!r}",
            param="response_format",
        )
    granularities = form.getlist("timestamp_granularities[]") + form.getlist(
        "timestamp_granularities"
    )
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise APIError(
                400,
                f"timestamp_granularities holds segment or word, got {granularity!r}",
                param="timestamp_granularities",
            )
        if granularity == "word":
            raise APIError(
                400,
                "word timestamps are not supported; ask for segment (one segment per "
                "30-second window)",
                param="timestamp_granularities",
            )
    if granularities and response_format != "verbose_json":
        raise APIError(
            400, "timestamp_granularities needs response_format verbose_json",
            param="timestamp_granularities",
        )  # fmt: skip
    if form.getlist("include[]"):
        raise APIError(400, "include[] (logprobs) is not supported", param="include")
    return TranscriptionForm(
        upload, text("model"), text("language"), text("prompt"), response_format, temperature,
        stream,
    )  # fmt: skip


def audio_windows(data: bytes, window_seconds: float) -> tuple[list[np.ndarray], float]:
    """(the windows of 16 kHz samples, seconds of audio) of an uploaded file; ValueError for
    bytes that are not audio. (Their features are made on the engine's thread: submit.)"""
    samples = decode_audio(data)
    return windows(samples, window_seconds), duration(samples)


async def create_transcription(state: TranscriptionState, raw_request: Request) -> Response:
    arrival = time.monotonic()
    service = state.service
    form = await read_form(raw_request)
    check_model_name(state.served_model_names, form.model)
    try:
        language = service.decoding.language(form.language)
    except ValueError as e:
        raise APIError(400, str(e), param="language") from None
    previous = []
    if form.prompt and form.prompt.strip():
        # As transformers' get_prompt_ids: the text after a space, without special tokens.
        previous = service.tokenizer.encode(" " + form.prompt.strip(), add_special_tokens=False)
    prompt = service.decoding.prompt(language, previous, service.config.max_target_positions)
    data = await form.upload.read()
    try:
        parts, seconds = await asyncio.to_thread(audio_windows, data, service.config.window_seconds)
    except ValueError as e:
        raise APIError(400, str(e), param="file") from None
    stream = service.submit(parts, prompt, form.temperature, new_id("trsc"), form.stream)
    num_windows = len(parts)
    state.metrics.prompt_tokens.inc(len(prompt) * num_windows)
    request = _Transcription(state, stream, prompt, num_windows, seconds, language, arrival)
    if form.stream:
        return StreamingResponse(request.events(), media_type="text/event-stream")
    await unless_disconnected(raw_request, request.collect())
    body, media_type = request.body(form.response_format)
    if isinstance(body, dict):
        body["usage"] = {"type": "duration", "seconds": math.ceil(seconds)}
        return JSONResponse(body, media_type=media_type)
    return PlainTextResponse(body, media_type=media_type)


class _Transcription:
    """One transcription's windows as they come back: gathered whole (`collect`, then `body`)
    or as SSE events (`events`)."""

    def __init__(self, state, stream: TranscriptionStream, prompt, num_windows, seconds, language,
                 arrival) -> None:  # fmt: skip
        self.state, self.stream, self.prompt = state, stream, prompt
        self.seconds, self.language, self.arrival = seconds, language, arrival
        self.tokens: list[list[int]] = [[] for _ in range(num_windows)]
        self.finish_reasons: list[str | None] = [None] * num_windows
        self.first_token_at: float | None = None

    async def outputs(self):
        """The windows' outputs as they come; leaving early, a timeout (APIError 504) or a
        cancellation (the client went away) aborts the windows still running."""
        deadline = Deadline(self.state.request_timeout)
        items = aiter(self.stream)
        try:
            while True:
                try:
                    output = await deadline(anext(items))
                except StopAsyncIteration:
                    break
                if output.token_ids and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.state.metrics.ttft.observe(self.first_token_at - self.arrival)
                self.tokens[output.window] += output.token_ids
                self.finish_reasons[output.window] = output.finish_reason
                yield output
        finally:
            self.stream.abort()
        self._count()

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    def _count(self) -> None:
        metrics = self.state.metrics
        metrics.generation_tokens.inc(sum(len(t) for t in self.tokens))
        reason = "length" if "length" in self.finish_reasons else "stop"
        metrics.requests_finished.labels(finish_reason=reason).inc()
        metrics.e2e.observe(time.monotonic() - self.arrival)
        self.state.audio_seconds.inc(self.seconds)

    def text_tokens(self, window: int) -> list[int]:
        """The window's tokens without its end of text."""
        tokens = self.tokens[window]
        eos = self.state.service.config.eos_token_id
        return tokens[:-1] if tokens and tokens[-1] == eos else tokens

    def segments(self):
        tokenizer = self.state.service.tokenizer
        texts = [
            tokenizer.decode(self.text_tokens(w), skip_special_tokens=True)
            for w in range(len(self.tokens))
        ]
        return window_segments(
            texts,
            [self.text_tokens(w) for w in range(len(self.tokens))],
            self.seconds,
            self.state.service.config.window_seconds,
        )

    def body(self, response_format: str):
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        return format_transcription(
            self.segments(), response_format, duration=self.seconds,
            language=LANGUAGES[self.language],
        )  # fmt: skip

    async def events(self) -> AsyncIterator[str]:
        """SSE: text deltas in window order (a later window's text waits for the earlier ones
        to finish), then the done event and [DONE]; an error ends it with an error event."""
        tokenizer = self.state.service.tokenizer
        num_windows = len(self.tokens)
        detokenizers = [IncrementalDetokenizer(tokenizer, self.prompt) for _ in range(num_windows)]
        held: list[list[str]] = [[] for _ in range(num_windows)]
        front = 0  # the first window not finished
        started = False  # the text's leading space is dropped, as in the json response
        try:
            async for output in self.outputs():
                w = output.window
                ids = [t for t in output.token_ids if t != self.state.service.config.eos_token_id]
                held[w].append(detokenizers[w].add_tokens(ids))
                if output.finish_reason is not None:
                    held[w].append(detokenizers[w].flush())
                while front < num_windows:
                    for delta in held[front]:
                        if not started:
                            delta = delta.lstrip()
                        if delta:
                            started = True
                            yield sse({"type": "transcript.text.delta", "delta": delta})
                    held[front] = []
                    if self.finish_reasons[front] is None:
                        break
                    front += 1
            output_tokens = sum(len(t) for t in self.tokens)
            input_tokens = len(self.prompt) * num_windows
            yield sse({
                "type": "transcript.text.done",
                "text": full_text(self.segments()),
                "usage": {"type": "tokens", "input_tokens": input_tokens,
                          "output_tokens": output_tokens,
                          "total_tokens": input_tokens + output_tokens},
            })  # fmt: skip
        except Exception as e:  # the request failed or the engine died: tell the client in-band
            yield sse_error(e)
        yield SSE_DONE
