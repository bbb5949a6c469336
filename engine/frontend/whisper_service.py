"""Serving Whisper: a `WhisperEngine` stepping on a thread of its own, fed by the HTTP
handlers' event loops (server/serving_transcriptions.py), and what the model folder says about
decoding: the decoder prompt's special tokens and the tokens `generate` suppresses.

One transcription is one request per 30-second window of its audio, submitted together: the
loop makes their log-mel features at admission, they run in the same continuous batch as
everyone else's, and the transcription's stream gets each window's new tokens after every step
(or, when it asks for no deltas, each window's tokens when it finishes). Leaving the stream
early (a client that went away, a timeout) aborts the windows still running, which frees both
their KV groups at once.

The engine loop runs in the server's own process (on the main thread under `pagedserve serve`,
as the decoder-only in-process engine does): the encoder and decoder are one model on one
device, and there is no separate core process for Whisper.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pagedserve import kernels
from pagedserve.engine.core.whisper_engine import TranscriptionRequest, WhisperEngine
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.async_engine import CommandLoop
from pagedserve.engine.frontend.audio import log_mel
from pagedserve.engine.frontend.client import (
    DrainingError,
    EngineDeadError,
    QueueFullError,
    post_to_loop,
)
from pagedserve.engine.messages import EngineStats
from pagedserve.engine.models.tokenizer import (
    TOKENIZER_FILES,
    load_tokenizer,
    synthetic_tokenizer,
)
from pagedserve.engine.models.weights import iter_safetensors_weights
from pagedserve.engine.models.whisper import WhisperModel
from pagedserve.engine.models.whisper_config import WhisperConfig, whisper_config_of
from pagedserve.engine.worker.kv_cache import GiB, default_cpu_kv_memory
from pagedserve.scheduler.utils import cdiv

logger = logging.getLogger("pagedserve")

# A client's prompt (previous text) keeps at most this share of the decoder's positions, its last
# tokens: Whisper's own limit (max_target_positions // 2 - 1 = 223 of 448), as transformers'.
_PROMPT_SHARE = 2


def _languages() -> tuple[dict[str, str], dict[str, str]]:
    """(code -> name, name or alias -> code): transformers' table of Whisper's languages."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return LANGUAGES, TO_LANGUAGE_CODE


@dataclass(frozen=True)
class WhisperDecoding:
    """The decoder prompt's special tokens and the suppressed tokens, from the folder's
    generation_config.json (config.json's fields, where it has none), as transformers'
    `generate` reads them. A model without them (a tiny test model, a built-in shape) starts
    from decoder_start_token_id alone."""

    decoder_start: int
    multilingual: bool = False
    english_only: bool = False  # an ".en" model: its config says is_multilingual false
    lang_to_id: dict[str, int] | None = None  # "<|en|>" -> id
    transcribe_id: int | None = None
    no_timestamps_id: int | None = None
    prev_id: int | None = None  # <|startofprev|>: the client's prompt follows it
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, folder: Path | None, config: WhisperConfig) -> WhisperDecoding:
        fields: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json"):  # the latter wins
            path = folder / name if folder is not None else None
            if path is not None and path.is_file():
                with open(path, encoding="utf-8") as f:
                    fields.update({k: v for k, v in json.load(f).items() if v is not None})
        lang_to_id = fields.get("lang_to_id") or None
        return cls(
            decoder_start=config.decoder_start_token_id,
            multilingual=bool(fields.get("is_multilingual", False)) and lang_to_id is not None,
            english_only=fields.get("is_multilingual") is False,
            lang_to_id=lang_to_id,
            transcribe_id=(fields.get("task_to_id") or {}).get("transcribe"),
            no_timestamps_id=fields.get("no_timestamps_token_id"),
            prev_id=fields.get("prev_sot_token_id"),
            suppress_tokens=tuple(fields.get("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(fields.get("begin_suppress_tokens") or ()),
        )

    def language(self, language: str | None) -> str:
        """The ISO-639-1 code of a request's `language` (a code or an English name, any case;
        none: "en", as vLLM defaults). ValueError for a language Whisper does not know or this
        model cannot transcribe."""
        names, codes = _languages()
        if language is None or not language.strip():
            return "en"
        wanted = language.strip().lower()
        code = wanted if wanted in names else codes.get(wanted)
        if code is None:
            raise ValueError(
                f"language {language!r} is not one Whisper knows; give an ISO-639-1 code such "
                "as en, de, fr or zh"
            )
        if self.multilingual and f"<|{code}|>" not in self.lang_to_id:
            raise ValueError(f"this model has no token for language {code!r}")
        if self.english_only and code != "en":
            raise ValueError(f"this model transcribes English only, not {code!r}")
        return code  # (a model without language tokens: the prompt does not name it)

    def prompt(
        self, language: str, previous_text_ids: Sequence[int], max_positions: int
    ) -> list[int]:
        """The decoder prompt: the client's prompt (after <|startofprev|>, its last tokens), then
        <|startoftranscript|>, and for a multilingual model <|lang|><|transcribe|>, then
        <|notimestamps|> (pagedserve does not predict timestamps)."""
        head = [self.decoder_start]
        if self.multilingual:
            head.append(self.lang_to_id[f"<|{language}|>"])
            if self.transcribe_id is not None:
                head.append(self.transcribe_id)
        if self.no_timestamps_id is not None:
            head.append(self.no_timestamps_id)
        previous: list[int] = []
        if previous_text_ids:
            keep = max_positions // _PROMPT_SHARE - 1
            previous = ([self.prev_id] if self.prev_id is not None else []) + list(
                previous_text_ids
            )[-keep:]
        return previous + head


def load_whisper(config: EngineConfig) -> tuple[WhisperModel, Any, WhisperDecoding]:
    """The model on its device and dtype, its tokenizer and decoding settings, for
    `config.model`: a folder of `WhisperForConditionalGeneration` (safetensors), its
    config.json, or a built-in shape (random weights: WHISPER_SHAPES)."""
    wconfig = whisper_config_of(config.model)
    if wconfig is None:
        raise ValueError(f"{config.model!r} is not a Whisper model")
    path = Path(config.model)
    folder = path if path.is_dir() else path.parent if path.is_file() else None
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    torch.manual_seed(config.seed)
    with device:  # random weights drawn where they run (1.5B of them for whisper-large-v3)
        model = WhisperModel(wconfig).eval()
    has_weights = folder is not None and path.is_dir() and any(folder.glob("*.safetensors"))
    if config.load_format == "dummy" or not has_weights:
        logger.warning("Whisper model %r: random weights (no safetensors, or --load-format "
                       "dummy)", config.model)  # fmt: skip
    elif config.load_format in ("auto", "safetensors"):
        model.load_weights(iter_safetensors_weights(folder))
    else:
        raise ValueError(f"--load-format {config.load_format} does not read Whisper folders")
    model.to(device, dtype)
    model.pack_weights()
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    elif folder is not None and any((folder / n).is_file() for n in TOKENIZER_FILES):
        tokenizer = load_tokenizer(folder)
    else:
        logger.warning(
            "Whisper model %r has no tokenizer: using a synthetic one over its %d token ids; "
            "text out is not the real model's; pass --tokenizer DIR for real text",
            config.model,
            wconfig.vocab_size,
        )
        # The synthetic tokenizer's view of a decoder: its vocabulary and end of text.
        vocab = SimpleNamespace(
            vocab_size=wconfig.vocab_size,
            bos_token_id=None,
            eos_token_ids=(wconfig.eos_token_id,),
            max_position_embeddings=wconfig.max_target_positions,
        )
        tokenizer = synthetic_tokenizer(vocab, name=f"synthetic:{config.model}")
    return model, tokenizer, WhisperDecoding.of(folder, wconfig)


def plan_blocks(config: EngineConfig, wconfig: WhisperConfig, dtype: torch.dtype) -> int:
    """KV blocks for both groups: --num-kv-blocks; else what --kv-cache-memory (on CPU by
    default 4 GiB, on a GPU the free memory times --gpu-memory-utilization) holds, but no more
    than --max-num-seqs full-length requests need."""
    bs = config.block_size
    per_block = 2 * wconfig.decoder_layers * bs * wconfig.d_model * dtype.itemsize
    per_request = cdiv(wconfig.max_source_positions, bs) + cdiv(wconfig.max_target_positions, bs)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    memory = config.kv_cache_memory
    if memory is None:
        device = config.torch_device()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory = int(free * config.gpu_memory_utilization)
        else:
            memory = default_cpu_kv_memory()
    return min(memory // per_block, config.max_num_seqs * per_request)


@dataclass(frozen=True)
class WindowOutput:
    """A window's tokens that are new since its last output; `finish_reason` on its last."""

    window: int
    token_ids: list[int]
    finish_reason: str | None = None


class TranscriptionStream:
    """The windows of one transcription, as their tokens come: iterate once. Leaving the loop
    early aborts the windows still running."""

    def __init__(self, service: TranscriptionService, request_ids: list[str], deltas: bool) -> None:
        self.request_ids = request_ids
        # False: each window's tokens come whole when it finishes, waking the event loop once
        # per window rather than every step (a whole answer needs nothing earlier).
        self.deltas = deltas
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[WindowOutput | BaseException] = asyncio.Queue()
        self._service = service
        self._unfinished = set(range(len(request_ids)))

    def __aiter__(self) -> AsyncIterator[WindowOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[WindowOutput]:
        try:
            while self._unfinished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self._unfinished.clear()  # the service has dropped them already
                    raise item
                if item.finish_reason is not None:
                    self._unfinished.discard(item.window)
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the windows still running; safe to call more than once."""
        if self._unfinished:
            self._service.abort([self.request_ids[w] for w in sorted(self._unfinished)])
            self._unfinished.clear()


class TranscriptionService(CommandLoop):
    """A WhisperEngine served to asyncio callers: `submit` from an event loop, `run` (this
    thread) or `start` (a thread of its own), `shutdown`. The lifecycle members are those the
    server's drain and /health read of the decoder-only engine client."""

    def __init__(
        self,
        engine: WhisperEngine,
        tokenizer: Any,
        decoding: WhisperDecoding,
        max_queue_len: int | None = None,
        backend: str = "torch",
    ) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 or None (no limit), got {max_queue_len}")
        self.engine = engine
        self.config = engine.model.config
        self.tokenizer = tokenizer
        self.decoding = decoding
        self.max_queue_len = max_queue_len
        self.backend = backend  # the attention backend's name, for the start-up line
        self.stats: EngineStats = engine.stats()
        self.draining = False
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_submitted and _windows_left
        self._num_submitted = 0  # windows handed to the loop (stats count those it queued)
        self._windows_left: dict[int, int] = {}  # id() of each unfinished stream -> its windows
        # Owned by the loop: request id -> (its stream, its window, tokens delivered).
        self._live: dict[str, tuple[TranscriptionStream, int, int]] = {}
        self._running = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, max_queue_len: int | None = None):
        model, tokenizer, decoding = load_whisper(config)
        weight = next(model.parameters())
        backend = kernels.resolve_backend(config.attention_backend, weight.device)
        ops = kernels.get_backend(backend)
        num_blocks = plan_blocks(config, model.config, weight.dtype)
        engine = WhisperEngine(
            model,
            num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget,
            ops=ops,
            seed=config.seed,
            suppress_tokens=decoding.suppress_tokens,
            begin_suppress_tokens=decoding.begin_suppress_tokens,
        )
        return cls(engine, tokenizer, decoding, max_queue_len, backend)

    def describe(self) -> str:
        c, engine = self.config, self.engine
        params = sum(p.numel() for p in engine.model.parameters())
        per_block = sum(k.nbytes + v.nbytes for k, v in engine.caches) / engine.pool.num_blocks
        return (
            f"Whisper, {params / 1e6:.1f}M parameters, {str(engine.dtype).removeprefix('torch.')} "
            f"on {engine.device}, {self.backend} attention; KV cache "
            f"{engine.pool.num_blocks} blocks of {engine.block_size} tokens "
            f"({engine.pool.num_blocks * per_block / GiB:.2f} GiB): "
            f"{engine.cross_blocks_per_request} cross-attention blocks per request for its "
            f"{c.max_source_positions} encoder positions, the rest for self-attention"
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_unfinished_requests(self) -> int:
        """Transcriptions accepted whose last window has not been delivered yet."""
        with self._lock:
            return len(self._windows_left)

    def start_draining(self) -> None:
        self.draining = True

    # ---- requests ------------------------------------------------------------------------------

    def submit(
        self,
        windows: Sequence[np.ndarray],
        prompt: list[int],
        temperature: float,
        request_id: str,
        deltas: bool = True,
    ) -> TranscriptionStream:
        """Queue one request per window of audio (16 kHz samples, engine/frontend/audio.py
        `windows`), each decoding from `prompt` for as long as the decoder's positions allow;
        `deltas`: a window's new tokens after every step (else all at once when it finishes). Call
        from a running event loop. Raises (nothing queued) ValueError for what the engine cannot
        run, QueueFullError, DrainingError and EngineDeadError."""
        if not self.is_running:
            raise EngineDeadError(f"the engine has stopped ({self._error!r}); restart the server")
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")
        if not windows:
            raise ValueError("no audio to transcribe")
        max_tokens = self.config.max_target_positions - len(prompt)
        self.engine.check_decoding(prompt, max_tokens, temperature)
        ids = [f"{request_id}-{i}" for i in range(len(windows))]
        stream = TranscriptionStream(self, ids, deltas)
        with self._lock:
            in_transit = self._num_submitted - self.stats.num_requests_added
            waiting = self.stats.num_waiting + in_transit
            if self.max_queue_len is not None and waiting >= self.max_queue_len:
                raise QueueFullError(
                    f"the server's waiting queue is full ({waiting} windows of audio wait, "
                    f"--max-queue-len {self.max_queue_len}); retry later"
                )
            self._num_submitted += len(ids)
            self._windows_left[id(stream)] = len(ids)
        self._commands.put(("add", (stream, list(windows), list(prompt), max_tokens, temperature)))
        return stream

    def _add(self, stream: TranscriptionStream, windows, prompt, max_tokens, temperature) -> None:
        """On the loop's thread: the windows' features, then their requests. Features are made
        here, not on the caller's thread: torch's parallel work on a second thread left the
        engine's steps 1.8x slower on 2 CPU cores (BENCHMARKS.md, "Whisper: transcription
        throughput through the endpoint")."""
        c = self.config
        features = log_mel(windows, c.num_mel_bins, c.num_frames)
        for window, (request_id, f) in enumerate(zip(stream.request_ids, features, strict=True)):
            request = TranscriptionRequest(request_id, f, prompt, max_tokens, temperature)
            self.engine.add(request)
            self._live[request_id] = (stream, window, 0)

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids))

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished
                commands = []
                try:
                    commands.append(self._commands.get(block=block))
                    while True:
                        commands.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for kind, payload in commands:
                    if kind == "stop":
                        self._fail_all(EngineDeadError("the server is shutting down"), commands)
                        return
                    if kind == "add":
                        try:
                            self._add(*payload)
                        except Exception as e:  # noqa: BLE001 - that request's, not the loop's
                            self._fail_stream(payload[0], e)
                    else:
                        for request_id in payload:
                            if engine.abort(request_id):
                                self._drop(request_id)
                finished = engine.step() if engine.has_unfinished else []
                self.stats = engine.stats()
                self._deliver(engine.running + finished)
        except KeyboardInterrupt:  # Ctrl-C while the loop runs on the main thread
            self._fail_all(EngineDeadError("the server is shutting down"))
            raise
        except BaseException as e:  # a bug or an out-of-memory: fail every request, go dead
            logger.exception("Whisper engine loop stopped")
            self._error = e
            self._fail_all(EngineDeadError(f"the engine has stopped ({e!r}); restart the server"))

    def _deliver(self, requests: list[TranscriptionRequest]) -> None:
        for r in requests:
            entry = self._live.get(r.request_id)
            if entry is None:
                continue
            stream, window, sent = entry
            if r.finish_reason is None and (len(r.output) == sent or not stream.deltas):
                continue
            output = WindowOutput(window, r.output[sent:], r.finish_reason)
            post_to_loop(stream.loop, stream.queue.put_nowait, output)
            if r.finish_reason is None:
                self._live[r.request_id] = (stream, window, len(r.output))
            else:
                self._drop(r.request_id)

    def _drop(self, request_id: str) -> None:
        """Forget a window; its stream is done when it was the stream's last."""
        key = id(self._live.pop(request_id)[0])
        with self._lock:
            self._windows_left[key] -= 1
            if not self._windows_left[key]:
                del self._windows_left[key]

    def _fail_stream(self, stream: TranscriptionStream, error: BaseException) -> None:
        """A transcription whose windows could not be added: its own error, the others go on."""
        logger.exception("transcription %s failed", stream.request_ids[0], exc_info=error)
        for request_id in stream.request_ids:
            if self.engine.abort(request_id):
                del self._live[request_id]
        with self._lock:
            self._windows_left.pop(id(stream), None)
        post_to_loop(stream.loop, stream.queue.put_nowait, error)

    def _fail_all(self, error: BaseException, commands: list[tuple] = ()) -> None:
        """Every stream gets `error`: those running and those whose windows are still among the
        commands not taken yet."""
        while True:
            try:
                commands = [*commands, self._commands.get_nowait()]
            except queue.Empty:
                break
        streams = {id(s): s for s, _, _ in self._live.values()}
        streams.update((id(p[0]), p[0]) for kind, p in commands if kind == "add")
        for stream in streams.values():
            post_to_loop(stream.loop, stream.queue.put_nowait, error)
        self._live.clear()
        with self._lock:
            self._windows_left.clear()
