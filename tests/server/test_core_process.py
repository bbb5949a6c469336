"""The engine core's own process under `pagedserve serve --core-process`: what happens when it dies,
and how Ctrl-C, SIGTERM and a killed server end both processes. Each test starts its own real
server of the embedded SmolLM2 (the session's servers must not be killed) and a streaming client
of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from pagedserve.engine.tp_endpoint import free_port
from tests.helpers import child_pids, process_alive
from tests.server.conftest import SMOLLM2_ARGS
from tests.server.util import PAGEDSERVE, sse_events

STREAM = {
    "model": "smollm2-135m-instruct",
    "prompt": "Count from one to a thousand:",
    "max_tokens": 1500,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log_path) -> None:
        self.proc, self.base, self.log_path = proc, base, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def core_pid(self) -> int:
        return int(re.search(r"engine core process (\d+) ready", self.log()).group(1))

    def health(self) -> int | None:
        """/health's status, or None when nothing listens any more."""
        try:
            return httpx.get(f"{self.base}/health", timeout=2).status_code
        except httpx.TransportError:
            return None


@contextmanager
def _server(tmp_path, *extra: str) -> Iterator[Server]:
    """`pagedserve serve` (with flags `extra`) in a session of its own (so a test can signal its
    process group as a terminal's Ctrl-C does); killed at the end whatever the test did."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PAGEDSERVE, "serve", "--port", str(port), "--no-access-log", *SMOLLM2_ARGS,
             "--kv-cache-memory", "0.5", "--core-process", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )  # fmt: skip
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 180
        while server.health() != 200:
            assert proc.poll() is None, server.log()
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Stream(threading.Thread):
    """A streaming completion read on a thread: its body, and an event once tokens arrive."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.started = base, None, threading.Event()
        self.error: httpx.TransportError | None = None

    def run(self) -> None:
        chunks = []
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=STREAM, timeout=120) as r:
                for chunk in r.iter_text():
                    chunks.append(chunk)
                    if "".join(chunks).count("data: ") >= 3:
                        self.started.set()
        except httpx.TransportError as e:  # a killed server cuts the stream
            self.error = e
        self.body = "".join(chunks)

    def events(self) -> list:
        self.join(60)
        assert self.body is not None, "the stream did not end"
        return sse_events(httpx.Response(200, text=self.body))


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


def test_a_dead_core_ends_streams_with_an_error_turns_health_503_and_exits_non_zero(tmp_path):
    with _server(tmp_path) as server:
        children = child_pids(server.proc.pid)
        core = server.core_pid
        assert core in children
        stream = _Stream(server.base)
        stream.start()
        assert stream.started.wait(60)
        os.kill(core, signal.SIGKILL)
        statuses = set()
        while server.proc.poll() is None:
            statuses.add(server.health())
            time.sleep(0.02)
        events = stream.events()
        assert stream.error is None
        assert server.proc.returncode == 1
        assert 503 in statuses  # /health said so before the server went away
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert 0 < len(events) - 1 < STREAM["max_tokens"]
        assert events[-1]["error"]["code"] == "engine_dead"
        assert "exited with code -9" in events[-1]["error"]["message"]
        assert "the server stops because the engine failed" in server.log()
        assert _wait_gone(children) == []


# The SIGTERM case takes the same road as Ctrl-C once the signal is in (`run_server` turns it into
# KeyboardInterrupt); it runs with `make test-slow`, to keep `make test` within its time.
@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("sigterm", marks=pytest.mark.slow)])
def test_ctrl_c_and_sigterm_stop_both_processes_and_end_streams(tmp_path, how):
    # A short drain: the stream outlasts it and gets the final error event at its end (the
    # default 20 s drain is test_shutdown.py's subject).
    with _server(tmp_path, "--shutdown-timeout", "0.5") as server:
        children = child_pids(server.proc.pid)
        stream = _Stream(server.base)
        stream.start()
        assert stream.started.wait(60)
        if how == "ctrl-c":  # a terminal sends SIGINT to the whole foreground process group
            os.killpg(server.proc.pid, signal.SIGINT)
        else:  # a service manager signals the server alone
            server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        events = stream.events()
        assert stream.error is None
        assert events[-1]["error"] == {
            "message": "the server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "engine_dead",
        }
        assert _wait_gone(children) == []
        assert "Traceback" not in server.log()


@pytest.mark.slow  # a server start of its own (~20 s); `make test-slow` runs it
def test_a_killed_server_takes_its_core_with_it(tmp_path):
    with _server(tmp_path) as server:
        core = server.core_pid
        stream = _Stream(server.base)
        stream.start()
        assert stream.started.wait(60)
        server.proc.kill()  # SIGKILL: no clean-up code runs in the server
        server.proc.wait()
        assert _wait_gone([core]) == []
        stream.join(60)
        assert isinstance(stream.error, httpx.RemoteProtocolError)
