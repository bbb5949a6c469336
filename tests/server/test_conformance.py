"""A conformance run of every generation and embedding endpoint, each through one client (a
keep-alive connection, a new one after a dropped stream): valid requests whole and streamed,
streams dropped after their first event, and invalid ones (a bad field, an unknown model, a body
that is not JSON). No answer is a 5xx, each error comes in its endpoint's own shape naming the
field, the connection stays usable, no KV block is held at the end and the server logs no
traceback."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.server.util import RunningServer, metric

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name a colour."}]

# endpoint path -> (a valid body, the field to break and its bad value, the error shape).
GENERATION = {
    "/v1/completions": (
        {"prompt": "Once upon a time", "max_tokens": 4},
        ("max_tokens", -1),
        "openai",
    ),
    "/v1/chat/completions": ({"messages": ASK, "max_tokens": 4}, ("temperature", -1), "openai"),
    "/v1/responses": ({"input": "Name a colour.", "max_output_tokens": 4}, ("input", 7), "openai"),
    "/v1/messages": ({"messages": ASK, "max_tokens": 4}, ("max_tokens", 0), "anthropic"),
}


def _error_of(shape: str, response: httpx.Response) -> tuple[str, str | None]:
    """(message, the field it names) of an error body, checked against the endpoint's shape."""
    body = response.json()
    if shape == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"], body["error"]["param"]


def _check_stream(path: str, response: httpx.Response, drop: bool) -> None:
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line for line in response.iter_lines() if line.startswith("data: ")]
    if drop:
        return
    events = [json.loads(line[6:]) for line in data if line != "data: [DONE]"]
    kinds = [event.get("type") or event.get("object") for event in events]
    # The last event; a Responses stream that ran out of max_output_tokens ends incomplete.
    last = {
        "/v1/completions": ("text_completion",),
        "/v1/chat/completions": ("chat.completion.chunk",),
        "/v1/responses": ("response.completed", "response.incomplete"),
        "/v1/messages": ("message_stop",),
    }[path]
    assert kinds[-1] in last, kinds
    assert "error" not in kinds, events


def _conform(server: RunningServer, path: str, valid: dict[str, Any], bad, shape: str) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": MODEL, **valid, "temperature": 0}
        whole = http.post(path, json=body)
        assert whole.status_code == 200, whole.text
        for drop in (False, True):
            with http.stream("POST", path, json={**body, "stream": True}) as stream:
                if drop:
                    next(stream.iter_lines())
                else:
                    _check_stream(path, stream, drop)
        field, value = bad
        refused = http.post(path, json={**body, field: value})
        assert refused.status_code == 400, refused.text
        message, param = _error_of(shape, refused)
        assert field in (param or message), (field, message, param)
        unknown = http.post(path, json={**body, "model": "no-such-model"})
        assert unknown.status_code == 404, unknown.text
        _error_of(shape, unknown)
        not_json = http.post(
            path, content=b'{"model": ', headers={"content-type": "application/json"}
        )
        assert not_json.status_code == 400, not_json.text
        _error_of(shape, not_json)
        # The same connection still answers.
        assert http.post(path, json=body).status_code == 200


def test_every_endpoint_conforms_and_leaves_no_block_held(server, embedding_server):
    for path, (valid, bad, shape) in GENERATION.items():
        _conform(server, path, valid, bad, shape)
    with httpx.Client(base_url=embedding_server.base_url, timeout=60) as http:
        ok = http.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": ["a", "b"]})
        assert [item["index"] for item in ok.json()["data"]] == [0, 1]
        for body, field in (
            ({"model": "all-minilm-l6-v2", "input": []}, "input"),
            (
                {"model": "all-minilm-l6-v2", "input": "a", "encoding_format": "hex"},
                "encoding_format",
            ),
            ({"model": "all-minilm-l6-v2", "input": "a", "dimensions": 7}, "dimensions"),
        ):
            refused = http.post("/v1/embeddings", json=body)
            assert refused.status_code == 400, refused.text
            _, param = _error_of("openai", refused)
            assert param == field
        assert http.post("/v1/embeddings", json={"input": "a", "model": "x"}).status_code == 404
    for running in (server, embedding_server):
        deadline = time.monotonic() + 10
        while metric(running, "pagedserve_kv_blocks_used") or metric(
            running, "pagedserve_num_requests_running"
        ):
            assert time.monotonic() < deadline, f"{running.base_url} still holds blocks"
            time.sleep(0.05)
        assert "Traceback" not in running.log()
