"""Real `pagedserve serve` processes on free local ports, started once per session.

- `server`: the embedded SmolLM2-135M-Instruct (fp32, CPU), no API key; most tests use it.
- `limited_server`: the same model with --api-key, --max-num-seqs 1 and --max-queue-len 1, for
  the 401 and 503 cases (a queue that fills needs a batch that is full).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

PAGEDSERVE = shutil.which("pagedserve") or str(Path(sys.executable).parent / "pagedserve")
MAX_MODEL_LEN = 2048
API_KEY = "test-key-0123456789"


@dataclass(frozen=True)
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path
    api_key: str | None = None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(log_path: Path, *args: str, timeout: float = 180.0) -> Iterator[RunningServer]:
    """Start `pagedserve serve ARGS` and wait until /health answers 200; stop it afterwards."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [PAGEDSERVE, "serve", "--port", str(port), "--no-access-log", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    server = RunningServer(f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with run_server(
        log_path,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "1",
    ) as s:
        yield s


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("limited-server") / "server.log"
    with run_server(
        log_path,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "0.25",
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
        "--api-key",
        API_KEY,
        "--served-model-name",
        "smol",
        "smol-alias",
    ) as s:
        yield RunningServer(s.base_url, s.log_path, API_KEY)
