"""`AsyncEngine`: the `EngineClient` (engine/frontend/client.py: request streams, ids, the queue
limit, failure state) that runs an LLMEngine's step loop on a thread of the server's process.
The other clients and what they share: engine/frontend/client.py.

    event loop thread (HTTP handlers)          engine loop thread (`run`)
    ─────────────────────────────────          ──────────────────────────
    add_request(): check, put ("add", ...)    ──> drain commands ─> LLMEngine.enqueue / abort
    iterate the RequestStream (asyncio.Queue) <── LLMEngine.step() ─> outputs, one
                                                  call_soon_threadsafe per step for all of them

Why a thread will do (`pagedserve serve --no-core-process`): the model's matmuls release the GIL,
so the HTTP side runs while the engine computes. There `pagedserve serve` runs this loop on the
*main* thread and uvicorn on a second one: on CPU, oneDNN/OpenMP work started from a non-main
thread runs markedly slower (measured: docs/benchmarks-history.md, "What changed on the way").
`start()` runs the loop on a background thread instead, for tests and embedding.

Only the loop touches LLMEngine (it is not thread-safe); handlers only read immutable things (the
tokenizer, the config) and the stats snapshot the loop publishes after every iteration.

A request whose consumer goes away (client disconnect, cancelled task) is aborted: the abort is
queued and the engine thread frees its blocks before its next step.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod

from pagedserve.engine.frontend.client import (
    EngineClient,
    EngineDeadError,
    RequestStream,
    post_to_loop,
)
from pagedserve.engine.frontend.inputs import NewRequest
from pagedserve.engine.frontend.llm_engine import LLMEngine

logger = logging.getLogger("pagedserve")


_STOP = object()


class CommandLoop(ABC):
    """An engine loop fed by a command queue, run on the calling thread (`run`) or a thread of
    its own (`start`) until a ("stop", ...) command (`shutdown`). Subclasses implement `_loop`
    and set `_running` and `_thread` up (False, None) with `_commands`."""

    _running: bool
    _thread: threading.Thread | None
    _commands: queue.SimpleQueue[tuple]

    @abstractmethod
    def _loop(self) -> None:
        """Take commands and step the engine until a "stop" command (or a failure)."""

    def run(self) -> None:
        """Run the loop in the calling thread until `shutdown()` (or an engine failure)."""
        if self._running:
            raise RuntimeError(f"{type(self).__name__} is already running")
        self._running = True
        try:
            self._loop()
        finally:
            self._running = False

    def start(self) -> None:
        """Run the loop on a background thread; returns once it accepts requests."""
        if self._running or self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
        self._running = True  # before the thread starts, so requests are accepted at once
        self._thread = threading.Thread(target=self._run_started, name="pagedserve-engine")
        self._thread.daemon = True
        self._thread.start()

    def _run_started(self) -> None:
        try:
            self._loop()
        finally:
            self._running = False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests in flight end with EngineDeadError); wait for start()'s
        thread. Safe to call from any thread, more than once."""
        if self._running:
            self._commands.put(("stop", _STOP))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


class AsyncEngine(CommandLoop, EngineClient):
    """Serves many concurrent `generate` calls from one LLMEngine running on a thread."""

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None) -> None:
        super().__init__(engine.inputs, max_queue_len)
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # set by start()
        self.stats = engine.stats()

    # ---- requests --------------------------------------------------------------------------------

    def _submit(self, request: NewRequest, stream: RequestStream) -> None:
        self._commands.put(("add", (request, stream)))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def rewind(self, request_id: str, num_tokens: int) -> None:
        with self._lock:
            if request_id not in self._ids_in_use:
                raise ValueError(f"request {request_id!r} is unknown or finished")
        self._commands.put(("rewind", (request_id, num_tokens)))

    def _ask_kv_map(self, query_id: int) -> None:
        self._commands.put(("kv_map", query_id))

    # ---- engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block while idle; otherwise take whatever arrived during the last step.
                block = not engine.has_unfinished_requests()
                commands = []
                try:
                    commands.append(self._commands.get(block=block))
                    while True:
                        commands.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for kind, payload in commands:
                    if kind == "stop":
                        self._fail_all(EngineDeadError("the server is shutting down"))
                        return
                    if kind == "add":
                        self._add(*payload)
                    elif kind == "rewind":
                        self._rewind(*payload)
                    elif kind == "kv_map":
                        self._answer_kv_map(payload, engine.kv_map())
                    else:
                        self._abort(payload)
                self.stats = engine.stats()  # aborts show in /metrics before the step
                outputs = engine.step() if engine.has_unfinished_requests() else []
                # Stats first: a consumer woken by its output must see the state after the step.
                self.stats = engine.stats()
                self._deliver(outputs)
        except KeyboardInterrupt:  # Ctrl-C while the loop runs on the main thread
            self._fail_all(EngineDeadError("the server is shutting down"))
            raise
        except BaseException as e:  # a bug or an out-of-memory: fail every request, go dead
            logger.exception("engine loop stopped")
            self._error = e
            self._fail_all(EngineDeadError(self._dead_message()))

    def _add(self, request: NewRequest, stream: RequestStream) -> None:
        self.engine.enqueue(request)
        self._streams[request.request_id] = stream

    def _rewind(self, request_id: str, num_tokens: int) -> None:
        try:
            self._deliver(self.engine.rewind(request_id, num_tokens))
        except ValueError as e:
            logger.warning("rewind of request %s dropped: %s", request_id, e)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._finish(request_id, stream)
            if output is not None:
                post_to_loop(stream.loop, stream.queue.put_nowait, output)
