"""Soak test: many mixed requests against a running server, then checks that nothing leaked.

pagedserve bench soak --base-url http://127.0.0.1:8000 --num-requests 2000 --concurrency 64 \
    --disconnect-fraction 0.2 --invalid-fraction 0.1 --output-json soak.json

The workload mixes /v1/completions and /v1/chat/completions, streamed and not, with random prompt
and output lengths (random words, or random token ids for completions). A fraction of the streams
is dropped by the client after a random number (at least one) of events, and a fraction of all
requests is deliberately invalid, rotating over the kinds in INVALID_KINDS, each with the 4xx
status it must get. Requests go through one httpx.AsyncClient (keep-alive connections, as real
clients use them), at most --concurrency at a time.

The first --warmup-fraction of the requests runs first; once the server is idle again its
resident memory (`pagedserve_resident_memory_bytes`, per process) is the baseline. After the rest,
and once the server reports no running or waiting request (the aborts of dropped streams land
asynchronously), the run fails (exit status 1) when:
- a valid request got a 5xx or another non-200 status, a connection error, a timeout, an error
  event, a malformed body, or a stream that was not dropped on purpose ended without
  `data: [DONE]` or without a finish_reason for every choice;
- an invalid request got other than its expected status, an error body not in the OpenAI shape
  {"error": {"message", "type", "param", "code"}}, or `Connection: close`;
- a KV block is still held (pagedserve_kv_blocks_used > 0) or a request still runs or waits;
- resident memory (all processes together) grew by more than --max-memory-growth (10%) between
  the end of the warm-up and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench.serve import (
    ENDPOINT_PATHS,
    NUM_FAILURES_SHOWN,
    SSEDecoder,
    _fmt,
    _max_model_len,
    _normalise_base_url,
    _setup_call,
    _stats,
    random_token_ids,
)
from pagedserve.server.limits import DEFAULT_MAX_N

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
KV_BLOCKS_USED = "pagedserve_kv_blocks_used"
KV_BLOCKS_TOTAL = "pagedserve_kv_blocks_total"
NUM_RUNNING = "pagedserve_num_requests_running"
NUM_WAITING = "pagedserve_num_requests_waiting"
RESIDENT_MEMORY = "pagedserve_resident_memory_bytes"
ENGINE_GAUGES = (NUM_RUNNING, NUM_WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)  # ServerSnapshot order
MIB = 1024 * 1024
# Room left for the tokens a chat template adds around the messages.
CHAT_TEMPLATE_TOKENS = 64


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the `bench soak` options to `p` (the caller owns the parser and its subcommand)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY"),
        help="sent as `Authorization: Bearer KEY` (default: $PAGEDSERVE_API_KEY if set)",
    )
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--min-input-len", type=int, default=4, help="prompt tokens (or words), min")
    p.add_argument("--max-input-len", type=int, default=128, help="prompt tokens (or words), max")
    p.add_argument("--min-output-len", type=int, default=1, help="max_tokens, min")
    p.add_argument("--max-output-len", type=int, default=32, help="max_tokens, max")
    for flag, default, text in (
        ("--disconnect-fraction", 0.2, "fraction of the streaming requests dropped mid-stream, "
         "after a random number (at least 1) of events"),
        ("--invalid-fraction", 0.1, "fraction of the requests that are deliberately invalid "
         "(each expects its 4xx)"),
        ("--warmup-fraction", 0.1, "fraction of the requests sent first; memory after them is "
         "the baseline"),
        ("--max-memory-growth", 0.10, "fail when resident memory grows by more than this "
         "fraction after the warm-up"),
        ("--timeout", 600.0, "seconds allowed per request"),
        ("--drain-timeout", 10.0, "seconds to wait for the server to go idle before reading "
         "the final metrics"),
    ):  # fmt: skip
        p.add_argument(flag, type=float, default=default, help=text)
    p.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help="the server's --max-n (the n_over_max requests send one more)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the whole workload")
    p.add_argument("--output-json", default=None, help="write the results here")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` parsed as `pagedserve bench soak` parses it."""
    parser = argparse.ArgumentParser(prog="pagedserve bench soak")
    add_arguments(parser)
    return parser.parse_args(argv)


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_requests", "concurrency", "min_input_len", "min_output_len", "max_n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for low, high in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if getattr(args, high) < getattr(args, low):
            raise ValueError(
                f"--{high.replace('_', '-')} must be at least --{low.replace('_', '-')}"
            )
    for name in ("disconnect_fraction", "invalid_fraction", "warmup_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.disconnect_fraction > 0 and args.max_output_len < 2:
        raise ValueError("--disconnect-fraction needs --max-output-len of at least 2")
    if not args.max_memory_growth >= 0:
        raise ValueError("--max-memory-growth must be a fraction of at least 0")
    if not args.timeout > 0:
        raise ValueError("--timeout must be a positive number of seconds")
    if not args.drain_timeout >= 0:
        raise ValueError("--drain-timeout must be at least 0 seconds")


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


# ---------------------------------------------------------------------------------------------
# The server's state (/metrics)
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerSnapshot:
    """What /metrics says at one moment. `memory` maps a process label to its resident bytes
    (empty when the server does not report it)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_blocks_used == 0


def parse_metrics(text: str) -> ServerSnapshot:
    """The snapshot in a /metrics text; ValueError when an engine gauge is missing."""
    values: dict[str, float] = {}
    memory: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RESIDENT_MEMORY:  # one per process; "core1": engine core 1's
                process = sample.labels.get("process", "") + sample.labels.get("engine", "")
                memory[process] = int(sample.value)
            elif not sample.labels:
                values[sample.name] = sample.value
            elif set(sample.labels) == {"engine"}:  # one per engine core: the server's is the sum
                values[sample.name] = values.get(sample.name, 0) + sample.value
    missing = [n for n in ENGINE_GAUGES if n not in values]
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(missing)}; is this a pagedserve server?")
    return ServerSnapshot(
        *(int(values[n]) for n in ENGINE_GAUGES),
        memory=memory,
    )


async def scrape(client: httpx.AsyncClient) -> ServerSnapshot:
    try:
        resp = await client.get("/metrics")
    except httpx.TransportError as e:
        raise ValueError(f"cannot read {client.base_url}/metrics ({type(e).__name__}: {e})") from e
    if resp.status_code != 200:
        raise ValueError(f"GET /metrics returned HTTP {resp.status_code}: {resp.text[:300]}")
    return parse_metrics(resp.text)


async def wait_until_idle(client: httpx.AsyncClient, timeout: float) -> ServerSnapshot:
    """The first snapshot with nothing running, waiting or holding blocks, or the last one after
    `timeout` seconds (aborts of dropped streams reach the engine asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = await scrape(client)
        if snapshot.idle or time.monotonic() >= deadline:
            return snapshot
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def build_report(
    outcomes: Sequence[Outcome],
    duration: float,
    before: ServerSnapshot | None,
    after: ServerSnapshot,
    max_memory_growth: float = 0.10,
) -> dict[str, Any]:
    """Counts, throughput, latency, the server's end state and the checks, with `passed` True
    only when every check passed. `before` is the snapshot at the end of the warm-up."""
    results = Counter(o.result for o in outcomes)
    failures = Counter(o.failure for o in outcomes if o.result == FAILED)
    completed = [o for o in outcomes if o.latency is not None]
    output_tokens = sum(o.completion_tokens for o in completed)
    summary: dict[str, Any] = {
        "num_requests": len(outcomes),
        "outcomes": {r: results.get(r, 0) for r in OUTCOMES},
        "failures": dict(sorted(failures.items())),
        "invalid": {kind: sum(1 for o in outcomes if o.kind == kind) for kind in INVALID_KINDS},
        "planned_disconnects": sum(o.planned_drop for o in outcomes),
        "duration": duration,
        "request_throughput": len(outcomes) / duration if duration > 0 else None,
        "completed_request_throughput": len(completed) / duration if duration > 0 else None,
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        **_stats([o.latency * 1000 for o in completed], "latency"),
        "kv_blocks_used_end": after.kv_blocks_used,
        "kv_blocks_total": after.kv_blocks_total,
        "num_requests_running_end": after.running,
        "num_requests_waiting_end": after.waiting,
        "memory_before": dict(before.memory) if before else {},
        "memory_after": dict(after.memory),
        "memory_growth": None,
    }

    checks: list[dict[str, Any]] = []

    def check(name: str, passed: bool | None, detail: str) -> None:
        checks.append({"name": name, "passed": passed, "detail": detail})

    n_failed = results.get(FAILED, 0)
    check(
        "no failed requests",
        n_failed == 0,
        "none" if not n_failed else ", ".join(f"{k}: {v}" for k, v in sorted(failures.items())),
    )
    check(
        "KV blocks released",
        after.kv_blocks_used == 0,
        f"{after.kv_blocks_used:g} of {after.kv_blocks_total:g} blocks held at the end",
    )
    check(
        "server idle",
        after.running == 0 and after.waiting == 0,
        f"{after.running:g} running, {after.waiting:g} waiting at the end",
    )
    if before is None or not before.memory or not after.memory:
        check("memory growth", None, "skipped: the server reports no resident memory")
    elif set(before.memory) != set(after.memory):
        check(
            "memory growth",
            False,
            f"processes changed: {sorted(before.memory)} after the warm-up, "
            f"{sorted(after.memory)} at the end",
        )
    else:
        total_before = sum(before.memory.values())
        growth = sum(after.memory.values()) / total_before - 1
        summary["memory_growth"] = growth
        check(
            "memory growth",
            growth <= max_memory_growth,
            f"{growth * 100:+.1f}% (limit +{max_memory_growth * 100:g}%)",
        )
    return {
        **summary,
        "checks": checks,
        "passed": all(c["passed"] is not False for c in checks),
    }


def _mib(memory: dict[str, int]) -> str:
    if not memory:
        return "n/a"
    parts = [f"{k} {v / MIB:.1f}" for k, v in sorted(memory.items())]
    return ", ".join(parts) + f", total {sum(memory.values()) / MIB:.1f}"


OUTCOME_LABELS = (
    (OK, "ok"),
    (DISCONNECTED, "disconnected by the client"),
    (COMPLETED_BEFORE_DROP, "completed before the planned drop"),
    (INVALID_AS_EXPECTED, "invalid, answered as expected"),
    (FAILED, "failed"),
)
REPORT_ROWS = (  # (label, key) in report order
    ("Duration (s):", "duration"),
    ("Request throughput (req/s):", "request_throughput"),
    ("  completed valid requests (req/s):", "completed_request_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("P50 latency, completed (ms):", "median_latency_ms"),
    ("P99 latency, completed (ms):", "p99_latency_ms"),
    ("KV blocks held at end:", "kv_blocks_used_end"),
)


def format_report(report: dict[str, Any]) -> str:
    width = 60

    def row(label: str, value: Any) -> str:
        return f"{label:<40} {_fmt(value)}"

    lines = [f"{' Soak Test Result ':=^{width}}", row("Requests:", report["num_requests"])]
    lines += [row(f"  {label}:", report["outcomes"][key]) for key, label in OUTCOME_LABELS]
    lines += [row(f"    {kind}:", n) for kind, n in report["failures"].items()]
    lines += [row(label, report[key]) for label, key in REPORT_ROWS]
    lines += [
        row("Requests running / waiting at end:", f"{report['num_requests_running_end']:g} / "
            f"{report['num_requests_waiting_end']:g}"),
        row("RSS after warm-up (MiB):", _mib(report["memory_before"])),
        row("RSS at end (MiB):", _mib(report["memory_after"])),
        f"{' Checks ':-^{width}}",
    ]  # fmt: skip
    for c in report["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[c["passed"]]
        lines.append(f"{verdict}  {c['name']}: {c['detail']}")
    lines.append(f"{' PASSED ' if report['passed'] else ' FAILED ':=^{width}}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running against a server
# ---------------------------------------------------------------------------------------------


async def _first_model(client: httpx.AsyncClient) -> str:
    models = await _setup_call(client, "GET", "/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if not data:
        raise ValueError(f"GET {client.base_url}/v1/models lists no models; pass --model")
    return data[0]["id"]


async def _soak(
    args: argparse.Namespace,
) -> tuple[str, list[Outcome], float, ServerSnapshot | None, ServerSnapshot]:
    base_url = _normalise_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # A connection for each request in flight and one for /metrics.
    limits = httpx.Limits(
        max_connections=args.concurrency + 1, max_keepalive_connections=args.concurrency + 1
    )
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = args.model or await _first_model(client)
        max_model_len = await _max_model_len(client, model)
        longest = args.max_input_len + args.max_output_len + CHAT_TEMPLATE_TOKENS
        if max_model_len is not None and longest > max_model_len:
            raise ValueError(
                f"--max-input-len {args.max_input_len} + --max-output-len {args.max_output_len} "
                f"+ {CHAT_TEMPLATE_TOKENS} for a chat template exceeds the server's "
                f"max_model_len {max_model_len}"
            )
        await scrape(client)  # a server without the metrics fails now, not after the run
        plan = make_plan(args, model, max_model_len)

        from tqdm import tqdm

        semaphore = asyncio.Semaphore(args.concurrency)
        progress = tqdm(total=len(plan), desc="requests", disable=None)

        async def one(p: PlannedRequest) -> Outcome:
            async with semaphore:
                outcome = await send(client, p, args.timeout)
            progress.update(1)
            return outcome

        async def phase(requests: list[PlannedRequest]) -> tuple[list[Outcome], float]:
            t0 = time.perf_counter()
            outcomes = await asyncio.gather(*(one(p) for p in requests))
            return list(outcomes), time.perf_counter() - t0

        warmup = [p for p in plan if p.warmup]
        with contextlib.closing(progress):
            outcomes, warmup_s = await phase(warmup)
            before = await wait_until_idle(client, args.drain_timeout)
            rest, rest_s = await phase([p for p in plan if not p.warmup])
        after = await wait_until_idle(client, args.drain_timeout)
    return model, outcomes + rest, warmup_s + rest_s, before, after


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak test described by `args` (from `add_arguments`), print the report, write the
    JSON if asked, and return the result (`passed` is the verdict).

    Raises ValueError for bad arguments or an unusable server. Starts its own event loop."""
    _validate(args)
    model, outcomes, duration, before, after = asyncio.run(_soak(args))
    report = build_report(outcomes, duration, before, after, args.max_memory_growth)
    config = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": _normalise_base_url(args.base_url),
        "model": model,
        **{
            name: getattr(args, name)
            for name in (
                "num_requests", "concurrency", "disconnect_fraction", "invalid_fraction",
                "min_input_len", "max_input_len", "min_output_len", "max_output_len",
                "warmup_fraction", "max_memory_growth", "max_n", "seed",
            )
        },
    }  # fmt: skip
    print(format_report(report))
    failed = [o for o in outcomes if o.result == FAILED]
    for o in failed[:NUM_FAILURES_SHOWN]:
        print(f"request {o.index} ({o.kind}, {o.endpoint}, stream={o.stream}) failed: "
              f"{o.failure}: {o.detail}")  # fmt: skip
    if len(failed) > NUM_FAILURES_SHOWN:
        print(f"... and {len(failed) - NUM_FAILURES_SHOWN} more failures (see --output-json)")
    result = {**config, **report, "requests": [asdict(o) for o in outcomes]}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
