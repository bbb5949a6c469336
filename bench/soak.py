"""Soak test: many mixed requests against a running server, then checks that nothing leaked.

pagedserve bench soak --base-url http://127.0.0.1:8000 --num-requests 2000 --concurrency 64 \
    --disconnect-fraction 0.2 --invalid-fraction 0.1 --output-json soak.json

The workload mixes /v1/completions and /v1/chat/completions, streamed and not, with random prompt
and output lengths (random words, or random token ids for completions). A fraction of the streams
is dropped by the client after a random number (at least one) of events, and a fraction of all
requests is deliberately invalid, rotating over the kinds in INVALID_KINDS (bench/soak_requests.py),
each with the 4xx status it must get. Requests go through one httpx.AsyncClient (keep-alive
connections, as real clients use them), at most --concurrency at a time.

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
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

import httpx

from pagedserve.bench.serve import (
    NUM_FAILURES_SHOWN,
    _max_model_len,
    _normalise_base_url,
    _setup_call,
)
from pagedserve.bench.soak_report import (
    ServerSnapshot,
    build_report,
    format_report,
    scrape,
    wait_until_idle,
)
from pagedserve.bench.soak_requests import FAILED, Outcome, PlannedRequest, make_plan, send
from pagedserve.server.limits import DEFAULT_MAX_N

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
