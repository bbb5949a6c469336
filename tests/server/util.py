"""Helpers for the end-to-end server tests (importable as tests.server.util): real
`pagedserve serve` processes and small clients of them."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from pagedserve.server.launch import server_process

# The console script, as a user runs it.
PAGEDSERVE = shutil.which("pagedserve") or str(Path(sys.executable).parent / "pagedserve")


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


def client(server, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.v1, api_key=server.api_key or "unused", max_retries=0, **kwargs
    )


def metric(server, name: str) -> float:
    """The value of an unlabelled sample in /metrics (e.g. pagedserve_kv_blocks_used)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in /metrics:\n{text}")


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse a whole SSE body into JSON objects, checking the framing; '[DONE]' must be last."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    parsed = []
    for event in events[:-2]:
        assert event.startswith("data: "), event
        parsed.append(json.loads(event.removeprefix("data: ")))
    assert events[-2] == "data: [DONE]"
    return parsed


def token_count(server, **body: Any) -> int:
    r = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return r.json()["count"]
