"""Helpers for the end-to-end server tests (importable as tests.server.util): real
`pagedserve serve` processes and small clients of them."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import threading
import time
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


def stream_choices(
    chunks: Any, kind: str, num_choices: int = 1
) -> tuple[list[list[Any]], list[str | None], dict | None]:
    """A stream read through the official client: each choice's pieces in order, its
    finish_reason, and the usage of the usage chunk (None without one). Checks the chunks' object
    (`kind`), one choice per chunk, nothing after a choice's finish_reason, and that the usage
    chunk carries no choice."""
    pieces: list[list[Any]] = [[] for _ in range(num_choices)]
    finish: list[str | None] = [None] * num_choices
    usage = None
    for chunk in chunks:
        assert chunk.object == kind
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage.model_dump()
            continue
        (choice,) = chunk.choices
        assert finish[choice.index] is None, "a chunk after the choice's finish_reason"
        pieces[choice.index].append(choice)
        finish[choice.index] = choice.finish_reason
    return pieces, finish, usage


@contextlib.contextmanager
def full_queue(server) -> Iterator[list[int]]:
    """On a server that runs one sequence and queues one (limited_server): a long stream holds
    the batch slot and a second request waits, so a third is refused while this is open. On
    leaving, the stream closes (the server aborts it) and the queued request runs; the list
    yielded then holds its status."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    long_body = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    waited: list[int] = []
    with httpx.stream(
        "POST", f"{server.v1}/completions", json={**long_body, "stream": True}, headers=headers,
        timeout=120,
    ) as running:  # fmt: skip
        assert running.status_code == 200
        # Keep the line iterator: a dropped one may close the response, and the server then
        # aborts the request.
        lines = running.iter_lines()
        next(lines)

        def wait_in_queue() -> None:
            body = {**long_body, "max_tokens": 2}
            r = httpx.post(f"{server.v1}/completions", json=body, headers=headers, timeout=120)
            waited.append(r.status_code)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        deadline = time.monotonic() + 30
        while metric(server, "pagedserve_num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        yield waited
    waiter.join(timeout=60)


def token_count(server, **body: Any) -> int:
    r = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return r.json()["count"]
