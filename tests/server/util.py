"""Small helpers for the end-to-end server tests (importable as tests.server.util)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai


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
