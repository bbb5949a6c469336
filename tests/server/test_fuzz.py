"""Schemathesis fuzzing of the HTTP API, from the server's own OpenAPI schema (/openapi.json).

For POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize, schemathesis generates
request bodies from the schema: positive ones (valid for the schema, most of them still refused
by the server's own checks) and negative ones (wrong types, a missing `prompt`, a body that is not
an object). Every case goes over one keep-alive connection per test, and every answer must be:

- there at all: a reset connection, or the server closing its keep-alive connection after a
  client's mistake, fails the test (the request is sent with `requests` directly, not through
  schemathesis' transport, which quietly resends a request whose connection was dropped);
- not a 5xx (schemathesis' `not_a_server_error`), and on a stream no in-band `server_error` event;
- a 4xx in the OpenAI error shape {"error": {"message", "type", "param", "code"}}, never FastAPI's
  documented 422 `{"detail": ...}`;
- a 200 that conforms to the schema where it says something (`response_schema_conformance`: the
  schema documents no fields of the completion responses, so a small check of their own shape
  here), with the content type of its kind (JSON, or Server-Sent Events ending in [DONE]).

`status_code_conformance` and `content_type_conformance` stay off: the schema documents only 200
and 422 (application/json), while the server answers 400/404 in the OpenAI shape and streams as
text/event-stream, so they would fail on every refused or streamed request.

And the server logs no traceback for any of it: a client's mistake is not a server error.

The server is the real SmolLM2 (fp32 on CPU), so every body is cut, after generation, to cost
little: max_tokens / max_completion_tokens to at most MAX_TOKENS (a generated max_tokens of 2000
would decode for a minute, and a null one means "the whole context"), n to MAX_SAMPLES, at most
MAX_PROMPTS short prompts, while counts the server refuses before any work (over the context,
over --max-n) are kept in the unsteered bodies. Two thirds of the bodies are also steered towards
the engine (a random model name is a 404 and random messages a 400 about their role, so without
that little would get past the checks): the served model, well-formed messages, token ids in the
vocabulary, none of the fields a random value of which is refused (suffix: SmolLM2 has no
FIM tokens; logit_bias: random keys are not token ids; tools, response_format), and
some of the values a client may well send: stream=true, chat_template_kwargs naming the template
call's own arguments, a sampling integer at the edge of the 64-bit range.
The number of examples is small and fixed, and the runs derandomized: the same cases each run.
"""

from __future__ import annotations

import json
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.generation import GenerationMode

from tests.server.conftest import MAX_MODEL_LEN

MODEL = "smollm2-135m-instruct"
VOCAB_SIZE = 49152  # SmolLM2's
MAX_N = 128  # the server's default --max-n

# The cost caps (see the module docstring). Each fuzzed completion decodes at most
# MAX_PROMPTS * MAX_SAMPLES * MAX_TOKENS tokens: about a second on CPU at worst.
MAX_TOKENS = 2
MAX_SAMPLES = 2
MAX_PROMPTS = 3

# Examples per endpoint: the fuzzing takes 5-10 s on 2 idle CPU cores, the server's start 20-25 s.
EXAMPLES = {
    "/v1/completions": 40,
    "/v1/chat/completions": 40,
    "/tokenize": 40,
    "/detokenize": 25,
}
REQUEST_TIMEOUT_S = 60


def _cap_count(value: Any, cap: int, refused_from: int | None) -> Any:
    """A count over cap (and under refused_from, where given) folded into [1, cap]; others (not
    an int, <= cap, or large enough to be refused before any work) as they are."""
    if isinstance(value, int) and not isinstance(value, bool) and value > cap:
        if refused_from is None or value < refused_from:
            return 1 + value % cap
    return value


def _in_vocab(ids: list[Any]) -> list[Any]:
    return [t % VOCAB_SIZE if isinstance(t, int) and not isinstance(t, bool) else t for t in ids]


_text = st.text(max_size=24)
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.one_of(
                _text,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3
                ),
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
# Keyword arguments for the chat template, with the names of apply_chat_template's own.
_template_kwargs = st.dictionaries(
    st.sampled_from(
        ["add_generation_prompt", "tokenize", "messages", "tools", "documents", "enable_thinking"]
    ),
    st.one_of(st.none(), st.booleans(), st.integers(-2, 2), _text),
    max_size=2,
)
# Integer fields of the sampling parameters, and integers at the edges of the 32- and 64-bit
# ranges (which JSON carries, and pydantic accepts, as they are): one of them may be set to one.
_INT_FIELDS = ["top_k", "seed", "n", "max_tokens", "stop_token_ids", "logprobs", "best_of"]
_EDGE_INTS = [2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]
_steering = st.fixed_dictionaries(
    {
        "edge_int": st.one_of(
            st.none(), st.tuples(st.sampled_from(_INT_FIELDS), st.sampled_from(_EDGE_INTS))
        ),
        # Two thirds of the bodies steered; the simplest example is one of them.
        "steer": st.sampled_from([True, True, False]),
        "stream": st.booleans(),
        "messages": _messages,
        "text": st.text(min_size=1, max_size=24),
        "use_messages": st.booleans(),
        "template_kwargs": st.one_of(st.none(), _template_kwargs),
    }
)


def _steer(path: str, body: Any, choice: dict[str, Any]) -> Any:
    """The generated body with the cost caps applied and, when `choice["steer"]`, made more
    likely to pass the server's checks: the served model, well-formed messages (or exactly one
    of prompt and messages for /tokenize), token ids in the vocabulary, and none of the fields
    a random value of which is refused (suffix, logit_bias, tools, response_format)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    chat = path == "/v1/chat/completions"
    completions = path == "/v1/completions"
    if choice["steer"]:
        if body.get("model") is None or isinstance(body["model"], str):
            body["model"] = MODEL
        for name in ("suffix", "logit_bias", "tools", "response_format"):
            body.pop(name, None)
        if (completions or chat) and choice["stream"]:
            body["stream"] = True
        if completions and "best_of" in body:
            body["best_of"] = body.get("n", 1)
        if chat or (path == "/tokenize" and choice["use_messages"]):
            body["messages"] = choice["messages"]
            body.pop("prompt", None)
            if choice["template_kwargs"] is not None:
                body["chat_template_kwargs"] = choice["template_kwargs"]
        elif path == "/tokenize":
            body["prompt"] = choice["text"]
            body.pop("messages", None)
        if path == "/detokenize" and isinstance(body.get("tokens"), list):
            body["tokens"] = _in_vocab(body["tokens"])
        if completions and "prompt" in body:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = [_in_vocab(p) if isinstance(p, list) else p for p in prompt]
                body["prompt"] = [p if p not in ("", []) else choice["text"] for p in prompt]
            elif isinstance(prompt, list) and prompt:
                body["prompt"] = _in_vocab(prompt)
            elif prompt in ("", []):
                body["prompt"] = choice["text"]
    if completions:
        # Few and short prompts: each one is a prefill on the CPU.
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            body["prompt"] = prompt[:64]
        elif isinstance(prompt, list):
            flat = bool(prompt) and isinstance(prompt[0], int)
            prompt = prompt[:64] if flat else prompt[:MAX_PROMPTS]
            body["prompt"] = [p[:64] if isinstance(p, str | list) else p for p in prompt]
    if completions or chat:
        # max_tokens null (or absent in chat) means "all the room left in the context".
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
        # Unsteered, the counts the server refuses before any work stay as they are.
        steer = choice["steer"]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = _cap_count(body[name], MAX_TOKENS, None if steer else MAX_MODEL_LEN)
        for name in ("n", "best_of"):
            if name in body:
                body[name] = _cap_count(body[name], MAX_SAMPLES, None if steer else MAX_N + 1)
    if choice["steer"] and (completions or chat):
        if choice["edge_int"] is not None:
            name, value = choice["edge_int"]
            if chat and name in ("logprobs", "best_of"):
                name = {"logprobs": "top_logprobs", "best_of": "max_completion_tokens"}[name]
            body[name] = [value] if name == "stop_token_ids" else value
        if chat and body.get("top_logprobs") is not None:
            body["logprobs"] = True
    return body


def _flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy:
    return _steering.map(lambda choice: _steer(context.operation.path, body, choice))


@pytest.fixture(scope="module")
def api_schema(server) -> schemathesis.BaseSchema:
    # Reports show bodies whole: by default schemathesis masks the values of keys that look
    # secret, and here that hides max_tokens ("token") in every report.
    config = schemathesis.Config.from_dict(
        {"output": {"sanitization": {"enabled": False}, "truncation": {"enabled": False}}}
    )
    schema = schemathesis.openapi.from_url(
        f"{server.base_url}/openapi.json", config=config, timeout=30
    )
    schema.hook("flatmap_body")(_flatmap_body)
    return schema


# ---- checks ---------------------------------------------------------------------------------


def _assert_openai_error(error_body: Any, where: str) -> None:
    assert isinstance(error_body, dict) and set(error_body) == {"error"}, where
    err = error_body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"], where
    assert isinstance(err["type"], str) and err["type"], where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] is None or isinstance(err["code"], str), where


def openai_errors(ctx, response, case) -> None:
    """Every error is a 4xx (400 for a bad request, 404 for an unknown model: the only ones a
    plain server without limits gives here) in the OpenAI shape, as JSON."""
    if response.status_code < 400:
        return
    where = f"{response.status_code} {response.content[:500]!r}"
    assert response.status_code in (400, 404), where
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), where
    body = json.loads(response.content)
    _assert_openai_error(body, where)
    assert body["error"]["type"] == "invalid_request_error", where
    if response.status_code == 404:
        assert body["error"]["code"] == "model_not_found", where


def _sse_events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = text.split("\n\n")[:-2]
    assert all(e.startswith("data: ") for e in events), text[:300]
    return [json.loads(e.removeprefix("data: ")) for e in events]


def successes(ctx, response, case) -> None:
    """A 200 has the shape of its endpoint; a stream is well-framed SSE whose error events (if
    any) are OpenAI-shaped client errors."""
    if response.status_code != 200:
        return
    content_type = response.headers.get("content-type", [""])[0]
    path = case.operation.path
    body = case.body if isinstance(case.body, dict) else {}
    where = f"200 {response.content[:500]!r}"
    generates = path in ("/v1/completions", "/v1/chat/completions")
    if body.get("stream") is True and generates:
        assert content_type.startswith("text/event-stream"), where
    # (pydantic also reads a few other values, e.g. 1 or "yes", as stream=true)
    if content_type.startswith("text/event-stream"):
        assert generates and body.get("stream") not in (None, False), where
        for event in _sse_events(response.content.decode()):
            if "error" in event:
                _assert_openai_error(event, where)
                assert event["error"]["type"] != "server_error", where
            else:
                assert isinstance(event.get("choices"), list), where
        return
    assert content_type.startswith("application/json"), where
    data = json.loads(response.content)
    if path == "/tokenize":
        assert data["count"] == len(data["tokens"]), where
        assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in data["tokens"]), where
    elif path == "/detokenize":
        assert isinstance(data["prompt"], str), where
    else:
        kind = "text_completion" if path == "/v1/completions" else "chat.completion"
        assert data["object"] == kind and data["model"] == MODEL, where
        assert data["choices"], where
        for choice in data["choices"]:
            assert choice["finish_reason"] in ("stop", "length"), where
        assert data["usage"]["total_tokens"] == (
            data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
        ), where


CHECKS = [not_a_server_error, response_schema_conformance, openai_errors, successes]


# ---- the tests -------------------------------------------------------------------------------


def _local_port(response: requests.Response) -> int | None:
    """The local port of the connection a (not yet read) response came on; None when the server
    said it closes the connection (http.client lets go of the socket then)."""
    connection = response.raw.connection
    sock = connection.sock if connection is not None else None
    return sock.getsockname()[1] if sock is not None else None


@pytest.mark.parametrize("path", list(EXAMPLES))
def test_fuzz_endpoint(server, api_schema, path):
    operation = api_schema[path]["POST"]
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )
    log_start = server.log_path.stat().st_size
    port: int | None = None  # of the keep-alive connection, once the first request opened it
    previous: Any = None  # the body sent before, for a connection dropped after it

    with requests.Session() as session:

        @hypothesis.settings(
            max_examples=EXAMPLES[path],
            deadline=None,
            derandomize=True,
            database=None,
            # No shrinking: each step is a request to the model, and the failure's report names
            # the body that failed already.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.filter_too_much,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
            ],
        )
        @given(case=strategy)
        def fuzz(case) -> None:
            nonlocal port, previous
            kwargs = case.as_transport_kwargs(base_url=server.base_url)
            sent = case.body
            try:
                response = session.request(**kwargs, timeout=REQUEST_TIMEOUT_S, stream=True)
                used = _local_port(response)
                response.content  # noqa: B018 - reads the whole body
            except requests.RequestException as e:
                pytest.fail(f"no response to {path} {sent!r}: {e!r}")
            assert used is not None, f"{path} {sent!r}: the server closes the connection"
            # One connection for the whole run: a new one means the server closed the last.
            assert port is None or used == port, (
                f"the server closed the keep-alive connection after {path} {previous!r}"
            )
            port, previous = used, sent
            case.validate_response(response, checks=CHECKS)

        fuzz()

    log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-5000:]
