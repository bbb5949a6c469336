"""`POST /v1/audio/transcriptions`: OpenAI's multipart form in, the transcription out
in the response format asked for, or streamed as server-sent text deltas.

The form: `file` (WAV, FLAC, MP3 or OGG; engine/frontend/audio.py), `model`, `language` (ISO-639-1
code or English name; default en), `prompt` (text the model takes as what came before),
`response_format` (json, text, verbose_json, srt, vtt), `temperature` (0: greedy), `stream`,
`timestamp_granularities[]` (segment; verbose_json only). The audio is cut into 30-second
windows, each an engine request of its own (an AudioPrompt: the decoder prompt and the window's
samples) in the continuous batch, through whichever engine client the server runs (in-process,
core process, data parallel); their texts join in order. A stream sends each window's text as it
is decoded, in window order: `{"type": "transcript.text.delta", "delta": ...}` events, then one
`transcript.text.done` with the whole text and the token usage, then `[DONE]`, the events
OpenAI's client reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import Counter
from starlette.datastructures import UploadFile

from pagedserve.engine.frontend.audio import decode_audio, duration, windows
from pagedserve.engine.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.engine.frontend.inputs import AudioPrompt
from pagedserve.engine.models.whisper_config import WhisperConfig, WhisperDecoding
from pagedserve.scheduler import SamplingParams
from pagedserve.server.audio.transcription_formats import (
    RESPONSE_FORMATS,
    format_transcription,
    full_text,
    window_segments,
)
from pagedserve.server.errors import APIError
from pagedserve.server.metrics.pagedserve_metrics import Metrics
from pagedserve.server.serving_common import (
    ServerState,
    add_requests,
    check_model_name,
    iterate_all,
    new_id,
    sse_stream,
    unless_disconnected,
)

logger = logging.getLogger("pagedserve")

FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream",
          "timestamp_granularities[]", "timestamp_granularities", "include[]",
          "chunking_strategy")  # fmt: skip
STREAM_FORMATS = ("json", "text")  # a stream carries text deltas: no segments to time


@dataclass(frozen=True)
class TranscriptionState:
    """What the handler needs beside the server's state; one per app serving a Whisper model."""

    server: ServerState
    whisper: WhisperConfig
    decoding: WhisperDecoding  # the decoder prompt's special tokens, from the model's folder
    audio_seconds: Counter


class WindowOutput(NamedTuple):
    """A window's tokens that are new since its last output; `finish_reason` on its last."""

    window: int
    token_ids: list[int]
    finish_reason: str | None


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
    bytes that are not audio. (Their features are made where the encoder runs.)"""
    samples = decode_audio(data)
    return windows(samples, window_seconds), duration(samples)


async def create_transcription(state: TranscriptionState, raw_request: Request) -> Response:
    arrival = time.monotonic()
    server, whisper = state.server, state.whisper
    form = await read_form(raw_request)
    check_model_name(server.served_model_names, form.model)
    try:
        language = state.decoding.language(form.language)
    except ValueError as e:
        raise APIError(400, str(e), param="language") from None
    previous = []
    if form.prompt and form.prompt.strip():
        # As transformers' get_prompt_ids: the text after a space, without special tokens.
        tokenizer = server.engine.tokenizer
        previous = tokenizer.encode(" " + form.prompt.strip(), add_special_tokens=False)
    prompt = state.decoding.prompt(language, previous, whisper.max_target_positions)
    data = await form.upload.read()
    try:
        parts, seconds = await asyncio.to_thread(audio_windows, data, whisper.window_seconds)
    except ValueError as e:
        raise APIError(400, str(e), param="file") from None
    # Each window decodes for as long as the decoder's positions allow, as `generate` does.
    params = SamplingParams(
        temperature=form.temperature,
        max_tokens=max(1, whisper.max_target_positions - len(prompt)),
        output_kind="delta",
    )
    prompts = [AudioPrompt(prompt, part) for part in parts]
    queued = add_requests(server, new_id("trsc"), prompts, [params] * len(parts), arrival)
    request = _Transcription(state, queued, prompt, len(parts), seconds, language)
    if form.stream:
        return StreamingResponse(sse_stream(request.events()), media_type="text/event-stream")
    await unless_disconnected(raw_request, request.collect())
    body, media_type = request.body(form.response_format)
    if isinstance(body, dict):
        body["usage"] = {"type": "duration", "seconds": math.ceil(seconds)}
        return JSONResponse(body, media_type=media_type)
    return PlainTextResponse(body, media_type=media_type)


class _Transcription:
    """One transcription's windows as they come back: gathered whole (`collect`, then `body`)
    or as SSE events (`events`)."""

    def __init__(self, state, queued, prompt, num_windows, seconds, language) -> None:
        self.state, self.queued, self.prompt = state, queued, prompt
        self.seconds, self.language = seconds, language
        self.tokens: list[list[int]] = [[] for _ in range(num_windows)]
        self.finish_reasons: list[str | None] = [None] * num_windows

    async def outputs(self) -> AsyncIterator[WindowOutput]:
        """The windows' outputs as they come; leaving early, a timeout (APIError 504), a failed
        window or a cancellation (the client went away) aborts the windows still running."""
        timeout = self.state.server.request_timeout
        async for window, output in iterate_all(self.queued, timeout):
            completion = output.outputs[0]
            self.tokens[window] += completion.token_ids
            self.finish_reasons[window] = completion.finish_reason
            yield WindowOutput(window, list(completion.token_ids), completion.finish_reason)
        self.state.audio_seconds.inc(self.seconds)

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    def text_tokens(self, window: int) -> list[int]:
        """The window's tokens without its end of text."""
        tokens = self.tokens[window]
        eos = self.state.whisper.eos_token_id
        return tokens[:-1] if tokens and tokens[-1] == eos else tokens

    def segments(self):
        tokenizer = self.state.server.engine.tokenizer
        texts = [
            tokenizer.decode(self.text_tokens(w), skip_special_tokens=True)
            for w in range(len(self.tokens))
        ]
        return window_segments(
            texts,
            [self.text_tokens(w) for w in range(len(self.tokens))],
            self.seconds,
            self.state.whisper.window_seconds,
        )

    def body(self, response_format: str):
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        return format_transcription(
            self.segments(), response_format, duration=self.seconds,
            language=LANGUAGES[self.language],
        )  # fmt: skip

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's events: text deltas in window order (a later window's text waits for
        the earlier ones to finish), then the done event (a failure raises)."""
        tokenizer = self.state.server.engine.tokenizer
        eos = self.state.whisper.eos_token_id
        num_windows = len(self.tokens)
        detokenizers = [IncrementalDetokenizer(tokenizer, self.prompt) for _ in range(num_windows)]
        held: list[list[str]] = [[] for _ in range(num_windows)]
        front = 0  # the first window not finished
        started = False  # the text's leading space is dropped, as in the json response
        async for output in self.outputs():
            w = output.window
            ids = [t for t in output.token_ids if t != eos]
            held[w].append(detokenizers[w].add_tokens(ids))
            if output.finish_reason is not None:
                held[w].append(detokenizers[w].flush())
            while front < num_windows:
                for delta in held[front]:
                    if not started:
                        delta = delta.lstrip()
                    if delta:
                        started = True
                        yield {"type": "transcript.text.delta", "delta": delta}
                held[front] = []
                if self.finish_reasons[front] is None:
                    break
                front += 1
        output_tokens = sum(len(t) for t in self.tokens)
        input_tokens = len(self.prompt) * num_windows
        yield {
            "type": "transcript.text.done",
            "text": full_text(self.segments()),
            "usage": {"type": "tokens", "input_tokens": input_tokens,
                      "output_tokens": output_tokens,
                      "total_tokens": input_tokens + output_tokens},
        }  # fmt: skip
