"""Real `pagedserve serve` processes on free local ports, started once per session.

- `server`: the embedded SmolLM2-135M-Instruct (fp32, CPU), no API key; most tests use it.
- `limited_server`: the same model with --api-key, --max-num-seqs 1 and --max-queue-len 1, for
  the 401 and 503 cases (a queue that fills needs a batch that is full).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.launch import server_process

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


@contextlib.contextmanager
def run_server(log_path: Path, *args: str) -> Iterator[RunningServer]:
    """`pagedserve serve ARGS` (the console script, as a user runs it) on a free port."""
    with server_process(
        ["--no-access-log", *args], log_path, command=[PAGEDSERVE], timeout=180
    ) as base_url:
        yield RunningServer(base_url, log_path)


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
