"""`pagedserve serve` in a child process: start it on a free port, wait until /health answers,
stop it (SIGTERM, then SIGKILL) on exit. For end-to-end tests and the serving benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from pagedserve.engine.tp_endpoint import free_port

# `python -m pagedserve.server.cli` is the `pagedserve` console script without needing it on PATH;
# -P keeps the working directory off sys.path (from a checkout, its folders would shadow installed
# modules: bench/__init__.py says why).
DEFAULT_COMMAND = (sys.executable, "-P", "-m", "pagedserve.server.cli")


@contextlib.contextmanager
def server_process(
    serve_args: Sequence[str],
    log_path: str | Path,
    *,
    port: int | None = None,
    command: Sequence[str] = DEFAULT_COMMAND,
    timeout: float = 300.0,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Run `COMMAND serve --port PORT SERVE_ARGS`, its output in `log_path`; yield the base URL
    (http://127.0.0.1:PORT) once healthy. Raises RuntimeError with the log's tail when the
    server exits or stays unhealthy for `timeout` seconds. `cwd` and `env` (default: this
    process's) are the child's."""
    port = free_port() if port is None else port
    base = f"http://127.0.0.1:{port}"
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*command, "serve", "--port", str(port), *serve_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "TOKENIZERS_PARALLELISM": "false"},
            cwd=cwd,
        )
        try:
            wait_healthy(proc, base, log_path, timeout)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    """Wait until the server `proc` started answers /health at `base`. Raises RuntimeError with
    the log's tail when it exits or stays unhealthy for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not _healthy(base):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {timeout} s:\n{_tail(log_path)}")
        time.sleep(0.2)


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or 503 while the engine loop is not running


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]
