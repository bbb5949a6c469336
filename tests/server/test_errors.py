"""Every client error gets its status and the OpenAI error shape, and the server answers the next
request normally."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import (
    ALLOWED_ORIGIN,
    MAX_MODEL_LEN,
    MAX_REQUEST_BODY_BYTES,
    REQUEST_TIMEOUT_S,
)
from tests.server.util import client, full_queue, metric

GOOD = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def _assert_error(r: httpx.Response, status: int, param: str | None = None, fragment: str = ""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert fragment in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def _assert_healthy(server) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    r = httpx.post(f"{server.v1}/completions", json=GOOD, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(" Paris")


LONG = list(range(1000, 1000 + MAX_MODEL_LEN + 10))  # token ids: a prompt longer than the context

BAD_COMPLETIONS = [
    pytest.param({**GOOD, "temperature": -1}, 400, "temperature", "temperature", id="temperature"),
    pytest.param({**GOOD, "top_p": 0}, 400, "top_p", "top_p", id="top_p"),
    pytest.param({**GOOD, "n": 0}, 400, "n", "n must be", id="n"),
    pytest.param({**GOOD, "n": "two"}, 400, "n", "integer", id="n-type"),
    pytest.param({**GOOD, "n": 129}, 400, "n", "n must be at most 128", id="n-over-max-n"),
    pytest.param({**GOOD, "logprobs": 21}, 400, "logprobs", "logprobs", id="logprobs"),
    pytest.param({**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens", id="max_tokens-0"),
    pytest.param(
        {**GOOD, "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
        f"maximum context length is {MAX_MODEL_LEN} tokens",
        id="max_tokens-too-many",
    ),
    pytest.param(
        {**GOOD, "prompt": LONG},
        400,
        None,
        f"prompt has {len(LONG)} tokens but max_model_len is {MAX_MODEL_LEN}",
        id="prompt-too-long",
    ),
    pytest.param({**GOOD, "prompt": [60000]}, 400, None, "outside the vocabulary", id="token-id"),
    pytest.param({**GOOD, "prompt": []}, 400, "prompt", "empty", id="empty-list"),
    pytest.param({**GOOD, "prompt": ""}, 400, None, "empty", id="empty-string"),
    pytest.param({"max_tokens": 3}, 400, "prompt", "prompt", id="missing-prompt"),
    pytest.param({**GOOD, "stop": [""]}, 400, "stop", "stop", id="empty-stop"),
    pytest.param({**GOOD, "suffix": "x"}, 400, "suffix", "suffix", id="suffix"),
    pytest.param({**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]", id="bias"),
    pytest.param({**GOOD, "model": "gpt-4"}, 404, "model", "gpt-4", id="unknown-model"),
    pytest.param(
        {**GOOD, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when stream is true",
        id="stream-options-without-stream",
    ),
    pytest.param({**GOOD, "seed": 2**63}, 400, "seed", "signed 64 bits", id="seed-too-big"),
    pytest.param({**GOOD, "seed": -(2**63) - 1}, 400, "seed", "signed 64", id="seed-too-small"),
    # Integers past 64 bits once reached the core process's msgpack encoder: a 500.
    pytest.param({**GOOD, "top_k": 2**64}, 400, "top_k", "top_k must be", id="top_k-too-big"),
    pytest.param(
        {**GOOD, "stop_token_ids": [2**64]},
        400,
        "stop_token_ids",
        "stop_token_ids must contain only ints in [0, 9223372036854775807]",
        id="stop-token-id-too-big",
    ),
    pytest.param({**GOOD, "n": 2, "best_of": 1}, 400, "best_of", ">= n (2)", id="best-of-below-n"),
    pytest.param({**GOOD, "best_of": 3, "temperature": 0}, 400, "best_of", "needs sampling",
                 id="best-of-greedy"),
    pytest.param({**GOOD, "best_of": 2, "stream": True}, 400, "stream", "cannot be streamed",
                 id="best-of-streamed"),
    pytest.param({**GOOD, "use_beam_search": True, "stream": True}, 400, "stream",
                 "use_beam_search cannot be streamed", id="beam-search-streamed"),
    pytest.param({**GOOD, "use_beam_search": True, "n": 2, "logprobs": 1}, 400, "logprobs",
                 "not supported with use_beam_search", id="beam-search-logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param", "fragment"), BAD_COMPLETIONS)
def test_completion_errors(server, body, status, param, fragment):
    err = _assert_error(
        httpx.post(f"{server.v1}/completions", json=body, timeout=30), status, param, fragment
    )
    assert err["type"] == "invalid_request_error"
    if status == 404:
        assert err["code"] == "model_not_found"
    _assert_healthy(server)


def test_errors_keep_the_connection_and_log_no_traceback(server):
    """Each invalid request, three times over one keep-alive connection: every answer is its
    OpenAI-shaped error (none a reset connection), and the server logs no traceback for a client's
    mistake. Checks that run inside the route handlers (prompt length, token ids, empty prompts)
    once went through Starlette's catch-all handler, which drops the connection after answering."""
    log_start = server.log_path.stat().st_size
    cases = [(f"{server.v1}/completions", p.values[0], p.values[1]) for p in BAD_COMPLETIONS]
    cases += [(f"{server.v1}/chat/completions", p.values[0], 400) for p in BAD_CHAT]
    with httpx.Client(timeout=30) as http:
        for url, body, status in cases:
            for _ in range(3):
                _assert_error(http.post(url, json=body), status)
        # The connection still serves a valid request.
        r = http.post(f"{server.v1}/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")
    log = server.log_path.read_text()[log_start:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


MSG = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    pytest.param({"messages": []}, "messages", id="no-messages"),
    pytest.param({"messages": [{"role": "wizard", "content": "hi"}]}, "role", id="role"),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "only 'text' parts",
        id="image-part",
    ),
    pytest.param({"messages": MSG, "top_logprobs": 2}, "logprobs=true", id="top-logprobs"),
    pytest.param({"messages": MSG, "tools": [{"type": "function"}]}, "tools", id="tools"),
    pytest.param(
        {"messages": MSG, "response_format": {"type": "xml"}},
        "response_format type 'xml' is not supported",
        id="response-format-type",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]},
        f"max_model_len is {MAX_MODEL_LEN}",
        id="too-long",
    ),
    # Found by tests/server/test_fuzz.py: both were 500s.
    pytest.param(
        {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs may not set add_generation_prompt",
        id="template-kwargs-taken",
    ),
    pytest.param(
        {"messages": MSG, "chat_template_kwargs": {"tools": True}},
        "the chat template could not render these messages and chat_template_kwargs: TypeError",
        id="template-kwargs-type",
    ),
]


@pytest.mark.parametrize(("body", "fragment"), BAD_CHAT)
def test_chat_errors(server, body, fragment):
    _assert_error(
        httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30), 400, None, fragment
    )
    _assert_healthy(server)


def test_tokenize_checks_chat_template_kwargs(server):
    url = f"{server.base_url}/tokenize"
    _assert_error(
        httpx.post(url, json={"messages": MSG, "chat_template_kwargs": "abc"}),
        400,
        "chat_template_kwargs",
        "valid dictionary",
    )
    _assert_error(
        httpx.post(url, json={"messages": MSG, "chat_template_kwargs": {"tokenize": False}}),
        400,
        None,
        "chat_template_kwargs may not set tokenize",
    )


def test_extreme_sampling_values_are_served(server):
    """Values inside the documented ranges that once overflowed float32 in the sampler: a
    temperature this small samples greedily (as in vLLM), and a tiny repetition_penalty still
    gives finite logits (once NaN, a 500)."""
    url = f"{server.v1}/completions"
    greedy = httpx.post(url, json=GOOD, timeout=30).json()["choices"][0]["text"]
    tiny_temperature = httpx.post(url, json={**GOOD, "temperature": 1e-40}, timeout=30)
    assert tiny_temperature.json()["choices"][0]["text"] == greedy
    r = httpx.post(url, json={**GOOD, "repetition_penalty": 1e-300}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]


def test_malformed_json_and_unknown_routes(server):
    r = httpx.post(
        f"{server.v1}/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400, None, "not valid JSON")
    _assert_error(httpx.get(f"{server.v1}/nothing-here"), 404)
    _assert_error(httpx.get(f"{server.v1}/completions"), 405)
    _assert_error(httpx.get(f"{server.v1}/models/gpt-4"), 404, "model", "gpt-4")
    _assert_healthy(server)


def test_openai_client_raises_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2-135m-instruct", prompt="hi", temperature=-2)
    assert e.value.body["param"] == "temperature"


def test_api_key_is_required_on_v1(limited_server):
    s = limited_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": s.api_key}):
        err = _assert_error(
            httpx.post(f"{s.v1}/completions", json=GOOD, headers=headers), 401, None, "API key"
        )
        assert err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.v1, api_key="wrong", max_retries=0).models.list()
    # The key opens /v1; /health and /metrics stay open for probes and scrapers.
    models = client(s).models.list()
    assert [m.id for m in models.data] == ["smol", "smol-alias"]
    assert httpx.get(f"{s.base_url}/metrics").status_code == 200
    r = client(s).completions.create(
        model="smol-alias", prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert r.model == "smol"
    _assert_healthy(s)


def test_full_waiting_queue_gives_503(limited_server):
    """max_num_seqs=1 and max_queue_len=1: one request runs, one waits, the third is refused."""
    s = limited_server
    headers = {"Authorization": f"Bearer {s.api_key}"}
    with httpx.Client(headers=headers, timeout=120) as http, full_queue(s) as waited:
        err = _assert_error(
            http.post(f"{s.v1}/completions", json={**GOOD}), 503, None, "queue is full"
        )
        assert err["code"] == "queue_full"
        retry = http.post(f"{s.v1}/completions", json={**GOOD})
        assert retry.status_code == 503 and retry.headers["retry-after"] == "1"
    # Closing the first stream aborted it; the queued request then ran and succeeded.
    assert waited == [200]
    _assert_healthy(s)


def test_request_timeout_aborts_and_frees_blocks(limited_server):
    """--request-timeout: a stream that would run for minutes ends at the deadline with a
    request_timeout error event and [DONE]; a request queued behind it (max_num_seqs 1) counts
    its time in the queue and gets a 504; afterwards no KV block is held and the server serves."""
    s = limited_server
    headers = {"Authorization": f"Bearer {s.api_key}"}
    # ~1,900 tokens: over a minute at this model's CPU speed, far past the timeout.
    body = {"prompt": "Count:", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}
    events: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST", f"{s.v1}/completions", json={**body, "stream": True}, headers=headers,
            timeout=120,
        ) as r:  # fmt: skip
            assert r.status_code == 200
            events.extend(line for line in r.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    start = time.monotonic()
    streamer.start()
    deadline = time.monotonic() + 30
    while metric(s, "pagedserve_num_requests_running") < 1:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    queued = httpx.post(f"{s.v1}/completions", json=body, headers=headers, timeout=120)
    err = _assert_error(queued, 504, None, f"--request-timeout of {REQUEST_TIMEOUT_S:g} s")
    assert (err["type"], err["code"]) == ("server_error", "request_timeout")
    streamer.join(timeout=60)
    elapsed = time.monotonic() - start
    assert REQUEST_TIMEOUT_S <= elapsed < REQUEST_TIMEOUT_S + 20
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "request_timeout"
    assert len(events) > 3  # tokens were streamed before the deadline
    deadline = time.monotonic() + 10
    while metric(s, "pagedserve_kv_blocks_used") or metric(s, "pagedserve_num_requests_running"):
        assert time.monotonic() < deadline, "the timed-out requests still hold blocks"
        time.sleep(0.05)
    _assert_healthy(s)


def test_request_body_over_the_limit_is_a_413(limited_server):
    """--max-request-body-bytes: a body over it is refused with a 413 in the OpenAI shape, from
    its Content-Length or, for a chunked body, once the bytes read pass the limit; the keep-alive
    connection then serves a valid request."""
    s = limited_server
    headers = {"Authorization": f"Bearer {s.api_key}"}
    big = {**GOOD, "prompt": "x" * (MAX_REQUEST_BODY_BYTES + 10)}
    with httpx.Client(headers=headers, timeout=60) as http:
        err = _assert_error(http.post(f"{s.v1}/completions", json=big), 413, None, "limit of")
        assert f"limit of {MAX_REQUEST_BODY_BYTES} bytes" in err["message"]
        assert err["type"] == "invalid_request_error"
        payload = json.dumps(big).encode()

        def chunks():  # no Content-Length: sent chunked
            for i in range(0, len(payload), 16_384):
                yield payload[i : i + 16_384]

        r = http.post(f"{s.v1}/completions", content=chunks())
        _assert_error(r, 413, None, f"limit of {MAX_REQUEST_BODY_BYTES} bytes")
        r = http.post(f"{s.v1}/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")


def test_cors_is_off_unless_origins_are_allowed(server, limited_server):
    """Without --allowed-origins no CORS header is ever sent (browsers then refuse cross-origin
    calls); with it, a preflight from an allowed origin is granted and others are not."""
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.get(f"{server.v1}/models", headers={"Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{server.v1}/completions", headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert "access-control-allow-origin" not in r.headers
    s = limited_server
    r = httpx.options(f"{s.v1}/completions", headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(
        f"{s.v1}/completions", headers={"Origin": "http://other.example", **preflight}
    )
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
