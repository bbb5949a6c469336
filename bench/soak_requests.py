"""The requests of `bench soak`: the workload planned from the seed (valid requests of random
shapes, deliberately invalid ones, streams to drop), then each request sent and what came back
checked, as an Outcome."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from pagedserve.bench.serve import ENDPOINT_PATHS, random_token_ids
from pagedserve.bench.serve_stream import SSEDecoder

# Outcomes of one request.
OK = "ok"  # a valid request answered in full
DISCONNECTED = "disconnected"  # a stream the client dropped on purpose
COMPLETED_BEFORE_DROP = "completed_before_drop"  # a stream to drop that finished first
INVALID_AS_EXPECTED = "invalid_as_expected"  # an invalid request with its 4xx, OpenAI-shaped
FAILED = "failed"
OUTCOMES = (OK, DISCONNECTED, COMPLETED_BEFORE_DROP, INVALID_AS_EXPECTED, FAILED)

VALID = "valid"
# Deliberately invalid requests: kind -> the status the server must answer with. The plan
# rotates over them in this order.
INVALID_KINDS: dict[str, int] = {
    "negative_token_id": 400,  # prompt [-1]
    "token_id_beyond_vocab": 400,  # prompt [10**9]
    "max_tokens_over_context": 400,  # a 1+ token prompt with max_tokens = max_model_len
    "negative_temperature": 400,
    "unknown_model": 404,
    "malformed_json": 400,  # a body cut off mid-object
    "message_without_role": 400,
    "n_over_max": 400,  # n = --max-n + 1
}
ERROR_KEYS = ("message", "type", "param", "code")
FINISH_REASONS = ("stop", "length")
# Ordinary English words, one token each (with the leading space) in common BPE vocabularies.
WORDS = tuple(
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "or has had first one their its new after but who not they have her she two been other when "
    "there all during into school time may years more most only over city some world would "
    "where later up such used many can state about national out known university united then "
    "made".split()
)


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the workload, decided before anything is sent."""

    index: int
    kind: str  # VALID, or a key of INVALID_KINDS
    endpoint: str  # a key of ENDPOINT_PATHS
    stream: bool
    body: dict[str, Any] | None = None  # sent as JSON
    raw_body: bytes | None = None  # sent as it is (malformed JSON)
    drop_after: int | None = None  # a stream dropped after this many events
    expected_status: int | None = None  # invalid requests
    warmup: bool = False

    @property
    def num_choices(self) -> int:
        return int(self.body.get("n", 1)) if self.body else 1


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _valid_body(
    rng: random.Random,
    args: argparse.Namespace,
    model: str,
    endpoint: str,
    stream: bool,
    drop: bool,
) -> dict[str, Any]:
    input_len = rng.randint(args.min_input_len, args.max_input_len)
    output_len = rng.randint(args.min_output_len, args.max_output_len)
    if drop:
        output_len = max(output_len, 2)
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": _words(rng, input_len)}]
    elif rng.random() < 0.5:
        body["prompt"] = random_token_ids(1, input_len, rng.randrange(2**32))[0]
    else:
        body["prompt"] = _words(rng, input_len)
    body["max_tokens"] = output_len
    body["temperature"] = rng.choice((0.0, 0.7, 1.0))
    if rng.random() < 0.1:
        body["n"] = 2
    # A stream to drop must still be running when it is dropped: it generates all its tokens.
    if drop or rng.random() < 0.5:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _invalid_request(
    kind: str, model: str, max_model_len: int | None, max_n: int, stream: bool
) -> tuple[str, dict[str, Any] | None, bytes | None]:
    """(endpoint, JSON body, raw body) of an invalid request of `kind`."""
    body: dict[str, Any] = {"model": model, "prompt": "Hello there", "max_tokens": 4}
    endpoint = "completions"
    if kind == "negative_token_id":
        body["prompt"] = [-1]
    elif kind == "token_id_beyond_vocab":
        body["prompt"] = [10**9]
    elif kind == "max_tokens_over_context":
        body["max_tokens"] = max_model_len if max_model_len is not None else 10**9
    elif kind == "negative_temperature":
        body["temperature"] = -1.0
    elif kind == "unknown_model":
        body["model"] = f"{model}-does-not-exist"
    elif kind == "malformed_json":
        return endpoint, None, json.dumps(body).encode()[:-5]
    elif kind == "message_without_role":
        endpoint = "chat"
        del body["prompt"]
        body["messages"] = [{"content": "Hello there"}]
    elif kind == "n_over_max":
        body["n"] = max_n + 1
    else:
        raise ValueError(f"unknown invalid request kind {kind!r}")
    if stream:
        body["stream"] = True
    return endpoint, body, None


def make_plan(
    args: argparse.Namespace, model: str, max_model_len: int | None
) -> list[PlannedRequest]:
    """The whole workload, from `args.seed`: exactly round(N * invalid_fraction) invalid requests
    (rotating over INVALID_KINDS in send order) at random positions, and exactly
    round(streams * disconnect_fraction) of the valid streams dropped."""
    rng = random.Random(args.seed)
    n = args.num_requests
    invalid = set(rng.sample(range(n), round(n * args.invalid_fraction)))
    endpoints = [rng.choice(sorted(ENDPOINT_PATHS)) for _ in range(n)]
    streams = [rng.random() < 0.5 for _ in range(n)]
    valid_streams = [i for i in range(n) if streams[i] and i not in invalid]
    drops = set(rng.sample(valid_streams, round(len(valid_streams) * args.disconnect_fraction)))
    num_warmup = round(n * args.warmup_fraction)
    kinds = list(INVALID_KINDS)
    plan = []
    for i in range(n):
        if i in invalid:
            kind = kinds[sum(p.kind != VALID for p in plan) % len(kinds)]
            endpoint, body, raw = _invalid_request(
                kind, model, max_model_len, args.max_n, streams[i]
            )
            planned = PlannedRequest(
                i, kind, endpoint, streams[i], body, raw, expected_status=INVALID_KINDS[kind]
            )
        else:
            drop = i in drops
            body = _valid_body(rng, args, model, endpoints[i], streams[i], drop)
            drop_after = rng.randint(1, body["max_tokens"] // 2) if drop else None
            planned = PlannedRequest(i, VALID, endpoints[i], streams[i], body, None, drop_after)
        plan.append(planned if i >= num_warmup else replace(planned, warmup=True))
    return plan


# ---------------------------------------------------------------------------------------------
# Sending and checking one request
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened to one request. `latency` (seconds) is set for valid requests answered in
    full; `failure` names the kind of failure when `result` is FAILED."""

    index: int
    kind: str
    endpoint: str
    stream: bool
    warmup: bool
    planned_drop: bool
    result: str
    failure: str = ""
    status: int | None = None
    detail: str = ""
    latency: float | None = None
    completion_tokens: int = 0
    events: int = 0  # stream events read (not counting [DONE])


def _outcome(p: PlannedRequest, result: str, **kw: Any) -> Outcome:
    return Outcome(
        p.index, p.kind, p.endpoint, p.stream, p.warmup, p.drop_after is not None, result, **kw
    )


def check_error_body(body: bytes) -> str:
    """Why `body` is not an OpenAI-shaped error ("" when it is)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return f"the error body is not JSON: {body[:200]!r}"
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        return f'the error body has no "error" object: {body[:200]!r}'
    missing = [k for k in ERROR_KEYS if k not in err]
    if missing:
        return f"the error object lacks {', '.join(missing)}: {body[:200]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"the error message is not a non-empty string: {body[:200]!r}"
    if not isinstance(err["type"], str) or not err["type"]:
        return f"the error type is not a non-empty string: {body[:200]!r}"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return f"the error's param or code is neither a string nor null: {body[:200]!r}"
    return ""


def _check_invalid(p: PlannedRequest, status: int, body: bytes, headers: httpx.Headers) -> Outcome:
    text = body[:300].decode("utf-8", errors="replace")
    if status != p.expected_status:
        return _outcome(
            p, FAILED, failure="invalid_wrong_status", status=status,
            detail=f"expected HTTP {p.expected_status}, got {status}: {text}",
        )  # fmt: skip
    shape = check_error_body(body)
    if shape:
        return _outcome(p, FAILED, failure="invalid_bad_error_shape", status=status, detail=shape)
    if headers.get("connection", "").lower() == "close":
        return _outcome(
            p, FAILED, failure="invalid_closed_connection", status=status,
            detail="a client error closed the keep-alive connection (Connection: close)",
        )  # fmt: skip
    return _outcome(p, INVALID_AS_EXPECTED, status=status)


def _check_choices(p: PlannedRequest, finished: set[int]) -> str:
    missing = sorted(set(range(p.num_choices)) - finished)
    return f"no finish_reason for choice(s) {missing}" if missing else ""


def _check_body(p: PlannedRequest, body: bytes, latency: float) -> Outcome:
    """A whole (non-streamed) completion."""
    try:
        payload = json.loads(body)
        choices = payload["choices"]
        finished = {c["index"] for c in choices if c.get("finish_reason") in FINISH_REASONS}
        tokens = int(payload["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError) as e:
        return _outcome(
            p, FAILED, failure="bad_response", status=200,
            detail=f"{type(e).__name__}: {e}: {body[:200]!r}",
        )  # fmt: skip
    missing = _check_choices(p, finished)
    if missing or len(choices) != p.num_choices:
        return _outcome(
            p, FAILED, failure="bad_response", status=200,
            detail=f"{len(choices)} choices for n={p.num_choices}; {missing}".rstrip("; "),
        )  # fmt: skip
    return _outcome(p, OK, status=200, latency=latency, completion_tokens=tokens)


async def _read_stream(p: PlannedRequest, resp: httpx.Response, start: float) -> Outcome:
    """Read an SSE response to its end (or drop it after p.drop_after events) and check it."""
    decoder = SSEDecoder()
    events = 0
    done = False
    finished: set[int] = set()
    usage: dict[str, Any] | None = None
    async for data in resp.aiter_bytes():
        for event in decoder.feed(data):
            if done:
                return _outcome(
                    p, FAILED, failure="bad_response", status=200, events=events,
                    detail=f"an event after [DONE]: {event[:200]!r}",
                )  # fmt: skip
            if event.strip() == "[DONE]":
                done = True
                continue
            events += 1
            try:
                payload = json.loads(event)
                if payload.get("error"):
                    return _outcome(
                        p, FAILED, failure="error_event", status=200, events=events,
                        detail=f"error event: {event[:300]}",
                    )  # fmt: skip
                for choice in payload.get("choices") or []:
                    if choice.get("finish_reason") in FINISH_REASONS:
                        finished.add(choice["index"])
                usage = payload.get("usage") or usage
            except (ValueError, AttributeError, KeyError, TypeError) as e:
                return _outcome(
                    p, FAILED, failure="bad_response", status=200, events=events,
                    detail=f"malformed stream event ({type(e).__name__}): {event[:200]!r}",
                )  # fmt: skip
            all_finished = not _check_choices(p, finished)
            if p.drop_after is not None and events >= p.drop_after and not all_finished:
                # Leaving the `client.stream` block unread closes the connection: the server
                # sees the client go away mid-stream.
                return _outcome(p, DISCONNECTED, status=200, events=events)
    latency = time.perf_counter() - start
    problems = [] if done else ["the stream ended without data: [DONE]"]
    missing = _check_choices(p, finished)
    if missing:
        problems.append(missing)
    if problems:
        return _outcome(
            p, FAILED, failure="incomplete_stream", status=200, events=events,
            detail="; ".join(problems),
        )  # fmt: skip
    if usage is None:
        return _outcome(
            p, FAILED, failure="bad_response", status=200, events=events,
            detail="no usage chunk although stream_options.include_usage was set",
        )  # fmt: skip
    result = COMPLETED_BEFORE_DROP if p.drop_after is not None else OK
    return _outcome(
        p, result, status=200, events=events, latency=latency,
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )  # fmt: skip


async def send(client: httpx.AsyncClient, p: PlannedRequest, timeout: float) -> Outcome:
    """Send one planned request and check what came back; never raises."""
    start = time.perf_counter()
    if p.raw_body is not None:
        content: dict[str, Any] = {
            "content": p.raw_body,
            "headers": {"content-type": "application/json"},
        }
    else:
        content = {"json": p.body}
    try:
        # httpx's timeout bounds each read; this one bounds the whole request.
        async with asyncio.timeout(timeout):
            async with client.stream("POST", ENDPOINT_PATHS[p.endpoint], **content) as resp:
                if p.expected_status is not None:
                    return _check_invalid(p, resp.status_code, await resp.aread(), resp.headers)
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode("utf-8", errors="replace")
                    failure = "http_5xx" if resp.status_code >= 500 else "unexpected_status"
                    return _outcome(
                        p, FAILED, failure=failure, status=resp.status_code,
                        detail=f"HTTP {resp.status_code}: {text}",
                    )  # fmt: skip
                if p.stream:
                    return await _read_stream(p, resp, start)
                body = await resp.aread()
                return _check_body(p, body, time.perf_counter() - start)
    except TimeoutError:
        return _outcome(p, FAILED, failure="timeout", detail=f"no answer within {timeout:g} s")
    except httpx.HTTPError as e:
        return _outcome(p, FAILED, failure="connection_error", detail=f"{type(e).__name__}: {e}")
