"""`pagedserve serve`: build the engine (weights, KV cache), then serve it over HTTP.

With the engine core in its own process (`--core-process`, the default;
engine/frontend/process_client.py), or several cores each in one (`--data-parallel-size M`;
engine/frontend/data_parallel.py), the main thread supervises them and uvicorn runs on a second
thread; in-process, the engine loop runs on the main thread instead (why:
engine/frontend/async_engine.py). Ctrl-C or SIGTERM drains (`_Drain`): new requests are refused
while those in flight finish, within --shutdown-timeout; then the engine stops, then uvicorn.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from pagedserve.engine.engine_config import EngineConfig, ModelOptions
from pagedserve.engine.frontend.client import EngineClient
from pagedserve.engine.frontend.data_parallel import DataParallelEngine
from pagedserve.engine.frontend.process_client import ProcessEngine
from pagedserve.server.server_config import ServerConfig

logger = logging.getLogger("pagedserve")


class RedactApiKey(logging.Filter):
    """Keeps the key of `/dashboard?api_key=KEY` (a browser cannot send a header when it opens
    a page) out of the access log, whose records carry the path with its query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and "api_key=" in a for a in args):
            record.args = tuple(
                re.sub(r"api_key=[^&\s]*", "api_key=***", a) if isinstance(a, str) else a
                for a in args
            )
        return True


# Whether the engine core runs in a process of its own, by device type (`--core-process`). On a
# GPU the split keeps HTTP and detokenization off the host loop that feeds the device. On CPU it
# serves faster too since the core's loop lost its per-request Python: 1.07x in-process at
# concurrency 16, 1.03x at 64 (BENCHMARKS.md, "Serving with the trimmed core loop").
DEFAULT_CORE_PROCESS = {"cuda": True, "cpu": True}

# How long the server keeps answering after its core process died: open streams get their error
# event out, and whoever polls /health sees 503 (not just a refused connection) before the exit.
DEAD_CORE_GRACE_S = 1.0


def run_server(config: EngineConfig, server: ServerConfig, log_level: str = "info") -> None:
    """Load the model and serve until interrupted (Ctrl-C / SIGTERM: see _Drain).
    `server.core_process`: run the engine core in a process of its own (None: the default for the
    device, DEFAULT_CORE_PROCESS). `server.data_parallel_size`: engine cores, each a process of
    its own with its own KV cache (engine/frontend/data_parallel.py); a Whisper model the same
    ways."""
    host, port = server.host, server.port
    _check_port_free(host, port)  # before loading: a model can take minutes to load
    names = list(server.served_model_name or [config.model.model])
    client, description, core_process = start_client(config, server, loop_thread=False)
    try:
        app = server_app(client, config.model, server)
        logger.info(
            "serving %s on http://%s:%d/v1 (%s, %s%s)",
            names[0],
            host,
            port,
            description,
            _where(client) if core_process else "engine core in this process",
            ", API key required" if server.api_key else "",
        )
        uvicorn_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            access_log=server.access_log,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
        )
        # After Config, which sets uvicorn's loggers up.
        logging.getLogger("uvicorn.access").addFilter(RedactApiKey())
        http_server = uvicorn.Server(uvicorn_config)
        http = threading.Thread(target=http_server.run, name="pagedserve-http", daemon=True)
        http.start()
        while not http_server.started:  # bind errors end the thread early
            if not http.is_alive():
                raise ValueError(f"could not serve on {host}:{port} (see the log above)")
            time.sleep(0.05)
    except BaseException:
        client.shutdown()
        raise

    def stop_engine_when_http_stops() -> None:
        http.join()
        client.shutdown()  # uvicorn ended by itself (e.g. a fatal error): end the engine

    threading.Thread(target=stop_engine_when_http_stops, daemon=True).start()
    drain = _Drain(client, server.shutdown_timeout)
    previous_term = signal.signal(signal.SIGTERM, drain.on_signal)
    previous_int = signal.signal(signal.SIGINT, drain.on_signal)
    try:
        if core_process:
            _wait_for_core(client)
        else:
            client.run()  # until the drain (or a failure) stops the engine
    finally:
        # Once the engine stopped, signals must not cut the rest short: it is bounded anyway
        # (the core gets SIGTERM, then SIGKILL).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            drain.stop_now()
            client.shutdown()  # first: streams in flight end at once, not after uvicorn's grace
            http_server.should_exit = True
            http.join(timeout=10)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)
    if client.error is not None:
        logger.error("the server stops because the engine failed: %r", client.error)
        raise SystemExit(1)


def start_client(
    config: EngineConfig, server: ServerConfig, loop_thread: bool = True
) -> tuple[EngineClient, str, bool]:
    """The engine client `pagedserve serve` runs for these configs, started (models loaded,
    requests accepted), its description, and whether its core runs in a process of its own.
    An in-process engine's loop runs on a thread of its own with `loop_thread`, else the caller
    runs it (`client.run()`, as `run_server` does on its main thread)."""
    if server.lora_modules and not config.lora.enable_lora:  # adapters to serve: LoRA is on
        config = dataclasses.replace(config, enable_lora=True)
    core_process = server.core_process
    if core_process is None:
        core_process = DEFAULT_CORE_PROCESS[config.model.torch_device().type]
    if server.data_parallel_size > 1:
        client = DataParallelEngine(config, server.data_parallel_size, server.max_queue_len)
        client.start()  # loads the model in every core process at once
        return client, client.description, True
    if core_process:
        client = ProcessEngine(config, max_queue_len=server.max_queue_len)
        client.start()  # loads the model in the core process; logs its plan there
        return client, client.description, True
    # The engine core in this process: only then does it import the model code.
    from pagedserve.engine.frontend.async_engine import AsyncEngine
    from pagedserve.engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(config)  # logs parameters, dtype, device and the KV-cache plan
    client = AsyncEngine(engine, max_queue_len=server.max_queue_len)
    if loop_thread:
        client.start()
    return client, engine.describe(), False


def server_app(client: EngineClient, model: ModelOptions, server: ServerConfig) -> FastAPI:
    """The FastAPI app over `client` serving `model` with the server's options (the caller runs
    the engine)."""
    # Imported here: the routes import transformers (a second), which `serve` does after it
    # launched the engine core, so that the two processes' start-ups overlap.
    from pagedserve.server.app import build_app

    return build_app(
        client,
        list(server.served_model_name or [model.model]),
        model_root=model.model,
        api_key=server.api_key,
        manage_engine=False,
        request_timeout=server.request_timeout,
        max_request_body_bytes=server.max_request_body_bytes,
        max_n=server.max_n,
        tool_call_parser=server.tool_call_parser,
        reasoning_parser=server.reasoning_parser,
        allowed_origins=list(server.allowed_origins or ()) or None,
        lora_modules=server.lora_modules or (),
    )


def _check_port_free(host: str, port: int) -> None:
    """ValueError when (host, port) cannot be bound now (another server listens there, or the
    host is not this machine's). uvicorn binds it again later; this only fails early."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        raise ValueError(
            f"could not serve on {host}:{port}: {e.strerror or e}; pick another --port or --host"
        ) from None


def _where(client: EngineClient) -> str:
    """Where the engine runs, for the startup line: "engine core in process 123", "2 engine
    cores in processes 123, 456"."""
    pids = client.core_pids
    if len(pids) == 1:
        return f"engine core in process {pids[0]}"
    return f"{len(pids)} engine cores in processes {', '.join(str(p) for p in pids)}"


def _wait_for_core(client: ProcessEngine | DataParallelEngine) -> None:
    """Return when a core process dies (after DEAD_CORE_GRACE_S) or uvicorn stops;
    KeyboardInterrupt on Ctrl-C/SIGTERM."""
    died = threading.Event()
    client.on_dead = died.set
    while client.is_running and not died.wait(0.1):  # a timeout: signals, and the drain's stop
        pass
    if client.error is not None:
        time.sleep(DEAD_CORE_GRACE_S)


class _Drain:
    """Graceful shutdown on SIGTERM or Ctrl-C: refuse new requests (503, and /health says 503),
    let those in flight finish for up to `timeout` seconds, then stop the engine, which ends
    the rest with a final error event. A second signal stops at once.

    The signal handler only sets events (it runs between two bytecodes of the main thread, which
    may hold any lock but these); a thread does the waiting and the logging."""

    def __init__(self, client: EngineClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self._signalled = threading.Event()
        self._now = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedserve-drain", daemon=True)
        self._thread.start()

    def on_signal(self, signum: int, frame: object) -> None:
        (self._now if self._signalled.is_set() else self._signalled).set()

    def stop_now(self) -> None:
        """Skip what is left of the drain and wait for the drain thread to finish."""
        self._now.set()
        self._signalled.set()
        self._thread.join()

    def _run(self) -> None:
        self._signalled.wait()
        if self._now.is_set():  # stop_now() without a signal: the engine already stopped
            return
        client = self.client
        client.start_draining()
        logger.info(
            "shutting down: %d requests in flight get up to %g s to finish (--shutdown-timeout); "
            "signal again to stop now",
            client.num_unfinished_requests,
            self.timeout,
        )
        deadline = time.monotonic() + self.timeout
        while client.num_unfinished_requests and not self._now.wait(
            min(0.05, max(0.0, deadline - time.monotonic()))
        ):
            if time.monotonic() >= deadline:
                break
        left = client.num_unfinished_requests
        if left:
            logger.warning("shutting down: aborting the %d requests still in flight", left)
        client.shutdown()
