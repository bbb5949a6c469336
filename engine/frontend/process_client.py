"""`ProcessEngine`: the server's client of an engine core in a process of its own (the process:
engine/core/process.py).

    API server process                                  engine core process (`run_engine_core`)
    ──────────────────                                  ───────────────────────────────────────
    HTTP, chat templates, InputProcessor                EngineCore: scheduler, runner, model
    add_request ─ OutputProcessor.add ─ AddRequest ──>  PULL ─> add_samples / abort_samples
    receiver thread <── CoreOutputs (per step) ──────── PUSH <─ step_samples + stats
      OutputProcessor.process: detokenize, stop strings
      (a stop string sends AbortSamples(stopped=True) back), deliver to the streams

Two ZeroMQ PUSH/PULL pairs over ipc:// sockets in a private temporary folder carry msgpack
(msgspec) encodings of engine/messages.py. The core's main thread runs only the engine loop, so
on a GPU the host work of the next step is never held up by HTTP, tokenization or
detokenization: those share the API server's GIL, not the core's.

Supervision: the API server starts the core (`start` waits for its CoreReady), watches it (a
receiver thread notices within 0.1 s when it has exited), and stops it (`shutdown`: a Shutdown
message, then SIGTERM, then SIGKILL). A core that dies fails every open stream with
EngineDeadError and calls `on_dead` (the server then exits non-zero). The core ignores SIGINT (a
Ctrl-C at the terminal reaches both processes; the server decides), exits on SIGTERM, and dies
with its parent (PR_SET_PDEATHSIG, and a parent-pid check while idle), so no orphan outlives a
killed server.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import threading
from collections.abc import Callable

import msgspec
import zmq

from pagedserve.engine.core.process import run_engine_core
from pagedserve.engine.engine_config import EngineConfig, LoRAOptions, ModelOptions
from pagedserve.engine.frontend.client import (
    EngineClient,
    EngineDeadError,
    RequestStream,
    post_to_loop,
)
from pagedserve.engine.frontend.inputs import InputProcessor, NewRequest
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.messages import (
    AbortSamples,
    AddRequest,
    CoreFailed,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    GetKVMap,
    KVMap,
    RewindSamples,
    Shutdown,
)
from pagedserve.engine.models.bert_config import context_length, embedding_pooling
from pagedserve.engine.models.model_source import resolve_model

logger = logging.getLogger("pagedserve")

_POLL_MS = 100  # how often the receiver looks at the core process while no output arrives


def front_end_inputs(model: ModelOptions, lora: LoRAOptions) -> InputProcessor:
    """The API server's InputProcessor for the model and LoRA options: the tokenizer and the
    limits, from the model's config (not its weights)."""
    # Here, not at the top: transformers takes a second to import, and a server launches its
    # core process before that (ProcessEngine.wait_started).
    from pagedserve.engine.models.tokenizer import load_tokenizer

    source = resolve_model(model.model)
    model_config = source.config
    pooling = embedding_pooling(source, model.task)
    return InputProcessor.for_model(
        load_tokenizer(source, model.tokenizer),
        model.model_len(context_length(model_config, pooling)),
        model_config,
        pooling,
        lora.max_lora_rank if lora.enable_lora else None,
    )


class ProcessEngine(EngineClient):
    """The server's engine when the core runs in a child process: tokenizer, input checks and
    output processing here, the model there."""

    def __init__(
        self,
        config: EngineConfig,
        max_queue_len: int | None = None,
        inputs: InputProcessor | None = None,
        num_threads: int | None = None,
    ) -> None:
        """`inputs`: the InputProcessor (tokenizer) to use, when the caller already has one for
        this config (several cores behind one server share it: engine/frontend/data_parallel.py);
        None: `wait_started` loads it while the launched core loads the model, each a matter of
        seconds, so that a server is ready sooner. `num_threads`: torch's intra-op threads in the
        core process (None: torch's default)."""
        super().__init__(inputs, max_queue_len)
        self.config = config
        self.num_threads = num_threads
        self.description = ""  # the core's device, dtype and KV cache, once started
        self.on_dead: Callable[[], None] | None = None  # called on the receiver thread
        self.output_processor: OutputProcessor | None = None
        if inputs is not None:
            self.use_inputs(inputs)
        # Guards the output processor, the streams and the input socket, which the event loop
        # (add, abort) and the receiver thread (outputs, stop strings) both use.
        self._state_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._process: multiprocessing.Process | None = None
        self._receiver: threading.Thread | None = None
        self._stopping = False
        self._folder: str | None = None
        self._context: zmq.Context | None = None
        self._input: zmq.Socket | None = None
        self._output: zmq.Socket | None = None

    def use_inputs(self, inputs: InputProcessor) -> None:
        """The front end's tokenizer and limits, before the core is ready."""
        self.inputs = inputs
        self.output_processor = OutputProcessor(inputs.tokenizer)

    @property
    def pid(self) -> int | None:
        """The core process's id while it runs."""
        return self._process.pid if self._process is not None else None

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def core_pids(self) -> list[int | None]:
        return [self.pid]

    def start(self) -> None:
        """Start the core process and wait until its model is loaded. Raises ValueError when the
        core refuses the config, RuntimeError when it dies while starting."""
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Start the core process without waiting for it (`wait_started` does): several cores
        load their models at the same time."""
        if self._process is not None:
            raise RuntimeError("ProcessEngine was already started")
        self._folder = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self._folder}/input"
        output_address = f"ipc://{self._folder}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        level = logging.getLogger("pagedserve").getEffectiveLevel()
        # spawn, not fork: the parent may hold threads and an initialised torch.
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(self.config, input_address, output_address, level, self.num_threads),
            name="pagedserve-core",
            daemon=True,  # multiprocessing ends it if this process exits without shutdown()
        )
        try:
            self._process.start()
        except BaseException:
            self.abandon()
            raise

    def wait_started(self) -> None:
        """Wait for the launched core's CoreReady; then requests are accepted. Raises as
        `start` does (the core is stopped first)."""
        if self.inputs is None:
            try:
                self.use_inputs(front_end_inputs(self.config.model, self.config.lora))
            except BaseException:  # the core may load for minutes yet: no waiting for it
                self.abandon(timeout=0)
                raise
        try:
            ready = self._wait_ready()
        except BaseException:  # includes Ctrl-C while the model loads
            self.abandon()
            raise
        if ready.max_model_len != self.max_model_len:
            raise AssertionError(
                f"core max_model_len {ready.max_model_len} != front end {self.max_model_len}"
            )
        self.description = ready.description
        self.stats = ready.stats
        logger.info("engine core process %d ready", self._process.pid)
        self._running = True
        self._receiver = threading.Thread(
            target=self._receive, name="pagedserve-core-outputs", daemon=True
        )
        self._receiver.start()

    def abandon(self, timeout: float = 5.0) -> None:
        """Stop a launched core that is not ready (yet): wait up to `timeout` seconds for it to
        exit by itself, then terminate it; close the sockets."""
        if self._process is not None and self._process.pid is not None:  # it started
            self._stop_process(timeout)
        self._close()

    def terminate(self) -> None:
        """SIGTERM the core process, from any thread: a `wait_started` in progress then raises
        and cleans up. (Stopping a running core is `shutdown`'s job.)"""
        process = self._process
        if process is not None and process.pid is not None and process.is_alive():
            process.terminate()

    def _wait_ready(self) -> CoreReady:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        while True:
            if self._output.poll(_POLL_MS):
                message = decoder.decode(self._output.recv())
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreFailed):
                    error = ValueError if message.value_error else RuntimeError
                    raise error(message.message)
                raise RuntimeError(f"unexpected message from the engine core: {message!r}")
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the engine core process exited with code {self._process.exitcode} while "
                    "starting (see the log above)"
                )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (requests in flight end with EngineDeadError) and wait for it. Safe to
        call from any thread but the receiver, more than once."""
        if self._process is None or self._stopping:
            return
        self._stopping = True
        with self._state_lock:
            self._fail_all(EngineDeadError("the server is shutting down"))
            if self._process.is_alive():
                try:
                    # Not blocking: a core that a signal to the whole process group has just
                    # ended has no socket left, and a PUSH socket with no peer would wait for
                    # one forever (seen after `kill -TERM -- -PGID`, about one time in three).
                    self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # _stop_process ends or reaps it
        self._stop_process(timeout)
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._running = False
        self._close()

    def _stop_process(self, timeout: float) -> None:
        process = self._process
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()

    def _close(self) -> None:  # (more than once is fine)
        for socket in (self._input, self._output):
            if socket is not None:
                socket.close(linger=0)
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # ---- requests (event loop thread) ------------------------------------------------------------

    def _submit(self, request: NewRequest, stream: RequestStream) -> None:
        request_id = request.request_id
        with self._state_lock:
            if not self.is_running or self._stopping:  # the core died since add_request checked
                self._finish(request_id, stream)
                post_to_loop(
                    stream.loop, stream.queue.put_nowait, EngineDeadError(self._dead_message())
                )
                return
            samples = self.output_processor.add(request)
            try:
                message = self._encoder.encode(AddRequest(samples))
            except BaseException:  # nothing may stay registered for a request never sent
                self.output_processor.abort(request_id)
                raise
            self._streams[request_id] = stream
            self._input.send(message)

    def rewind(self, request_id: str, num_tokens: int) -> None:
        with self._state_lock:
            sample_ids = self.output_processor.live_sample_ids(request_id)
            if self.is_running and not self._stopping:
                self._input.send(self._encoder.encode(RewindSamples(sample_ids, num_tokens)))

    def _ask_kv_map(self, query_id: int) -> None:
        with self._state_lock:
            if self.is_running and not self._stopping:
                self._input.send(self._encoder.encode(GetKVMap(query_id)))

    def abort(self, request_id: str) -> None:
        with self._state_lock:
            output, sample_ids = self.output_processor.abort(request_id)
            if sample_ids and self.is_running and not self._stopping:
                self._input.send(self._encoder.encode(AbortSamples(sample_ids)))
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._finish(request_id, stream)
                if output is not None:
                    post_to_loop(stream.loop, stream.queue.put_nowait, output)

    def fail_requests(self, error: BaseException) -> None:
        """End every open request with `error` and abort it in the core, which goes on running
        (a sibling core died: engine/frontend/data_parallel.py)."""
        with self._state_lock:
            sample_ids = [
                sample_id
                for request_id in list(self._streams)
                for sample_id in self.output_processor.abort(request_id)[1]
            ]
            if sample_ids and self.is_running and not self._stopping:
                self._input.send(self._encoder.encode(AbortSamples(sample_ids)))
            self._fail_all(error)

    # ---- receiver thread -------------------------------------------------------------------------

    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        while not self._stopping:
            if not self._output.poll(_POLL_MS):
                if not self._process.is_alive() and not self._stopping:
                    self._core_died()
                    return
                continue
            message = decoder.decode(self._output.recv())
            if isinstance(message, KVMap):
                self._answer_kv_map(message.query_id, message.kv_map)
                continue
            if not isinstance(message, CoreOutputs):
                logger.warning("unexpected message from the engine core: %r", message)
                continue
            with self._state_lock:
                results, stopped = self.output_processor.process(message.outputs)
                if stopped and not self._stopping:
                    self._input.send(self._encoder.encode(AbortSamples(stopped, stopped=True)))
                # Stats first: a consumer woken by its output must see the state after the step.
                self.stats = message.stats
                self._deliver(results)

    def _core_died(self) -> None:
        code = self._process.exitcode
        self._error = RuntimeError(f"the engine core process exited with code {code}")
        logger.error("%s; failing every open request", self._error)
        with self._state_lock:
            self._fail_all(EngineDeadError(self._dead_message()))
        if self.on_dead is not None:
            self.on_dead()
