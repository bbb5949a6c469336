"""Graceful shutdown of a real `pagedserve serve` (the dummy model): on SIGTERM or Ctrl-C it
refuses new requests with a 503 (and /health says 503) while the requests in flight finish,
within --shutdown-timeout; past it, or at a second signal, the rest end with a final error
event and [DONE]. The server exits 0 either way."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.engine.tp_endpoint import free_port
from pagedserve.server.launch import wait_healthy
from tests.server.util import PAGEDSERVE

# The dummy model with room for long streams: a stream whose end the test must not reach takes
# thousands of steps, so no machine is fast enough to finish it before the deadline.
LONG_CONTEXT = 8192
# About 1.5 s of decoding on a quiet machine (10 s on a loaded one): long enough to probe the
# draining server before it ends.
STREAM = {
    "prompt": [5, 6, 7],
    "max_tokens": 600,
    "n": 2,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
SHUTTING_DOWN = {
    "message": "the server is shutting down and accepts no new requests",
    "type": "server_error",
    "param": None,
    "code": "shutting_down",
}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    from tests.helpers import DUMMY_MODEL_CONFIG

    path = tmp_path_factory.mktemp("long-dummy-model") / "config.json"
    path.write_text(json.dumps({**DUMMY_MODEL_CONFIG, "max_position_embeddings": LONG_CONTEXT}))
    return path


@contextlib.contextmanager
def _server(tmp_path: Path, model: Path, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PAGEDSERVE, "serve", "--port", str(port), "--no-access-log", "--model", str(model),
             "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "0.01", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_healthy(proc, base, log_path, timeout=120)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Stream(threading.Thread):
    """A streamed completion read on a thread; `started` is set once its first event came."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__()
        self.base = base
        self.request = {**STREAM, "max_tokens": max_tokens}
        self.started = threading.Event()
        self.events: list[dict] = []
        self.done = False  # ended with [DONE]

    def run(self) -> None:
        url = f"{self.base}/v1/completions"
        with httpx.stream("POST", url, json=self.request, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                self.events.append(json.loads(line.removeprefix("data: ")))
                self.started.set()

    def finish_reasons(self) -> list[str]:
        choices = [c for e in self.events for c in e.get("choices", ())]
        return [c["finish_reason"] for c in choices if c["finish_reason"] is not None]


def _start_stream(base: str, max_tokens: int = STREAM["max_tokens"]) -> _Stream:
    stream = _Stream(base, max_tokens)
    stream.start()
    assert stream.started.wait(timeout=60)
    return stream


def test_sigterm_lets_the_requests_in_flight_finish(tmp_path, long_model):
    with _server(tmp_path, long_model, "--shutdown-timeout", "60") as (proc, base):
        stream = _start_stream(base)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the drain starts on the server's own thread
        assert stream.is_alive()
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert (refused.status_code, refused.json()) == (503, {"error": SHUTTING_DOWN})
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        stream.join(timeout=60)
        assert proc.wait(timeout=30) == 0
    assert stream.done and stream.finish_reasons() == ["length", "length"]
    assert stream.events[-1]["usage"]["completion_tokens"] == 2 * STREAM["max_tokens"]
    assert "Traceback" not in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize(
    "serve_args, second_signal",
    [
        # The deadline passes (the engine core in its own process, the default).
        (("--shutdown-timeout", "0.5"), None),
        # Ctrl-C twice: the second stops at once (the engine loop in the server's process).
        (("--shutdown-timeout", "60", "--no-core-process"), signal.SIGINT),
    ],
    ids=["deadline", "second-signal"],
)
def test_requests_still_running_at_the_end_get_a_final_error_event(
    tmp_path, long_model, serve_args, second_signal
):
    with _server(tmp_path, long_model, *serve_args) as (proc, base):
        stream = _start_stream(base, max_tokens=LONG_CONTEXT - 100)
        proc.send_signal(signal.SIGINT)
        if second_signal is not None:
            time.sleep(0.3)
            assert stream.is_alive()  # still draining
            proc.send_signal(second_signal)
        stream.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    assert stream.done
    error = stream.events[-1]
    assert error == {
        "error": {
            "message": "the server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "engine_dead",
        }
    }
    assert stream.finish_reasons() == []  # cut short: no sample reached its end
    log = (tmp_path / "server.log").read_text()
    assert "shutting down: aborting the 1 requests still in flight" in log
    assert "Traceback" not in log
