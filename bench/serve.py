"""Online serving benchmark: a load-test client for a running OpenAI-compatible server.

pagedserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 \
    --output-len 64 --max-concurrency 16 --request-rate 8 --json out.json --plot out.png

Like `vllm bench serve`: streaming requests (Poisson arrivals, optional concurrency cap) to
/v1/completions or /v1/chat/completions, SSE parsed by hand, and a report of request and token
throughput with TTFT, TPOT, ITL and end-to-end latency statistics.

Times inside a RequestRecord are seconds, measured with time.perf_counter from the start of the
benchmark; the summary reports latencies in milliseconds (keys ending in `_ms`). The per-request
lists in the JSON (`ttfts`, `itls`, `e2els`, `start_times`) stay in seconds, as vLLM writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from pagedserve.bench.serve_report import format_report, per_request_lists, plot_results, summarize
from pagedserve.bench.serve_stream import RequestRecord, StreamRecorder

# Random prompts draw ids from this range. The server does not expose its vocabulary size, and
# ids below ~1000 hold bytes and special tokens in most BPE vocabularies, so [1000, 10000) is a
# safe range of ordinary tokens for any vocabulary of at least 10k entries.
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 10000

NUM_FAILURES_SHOWN = 5
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the `bench serve` options to `p` (the caller owns the parser and its subcommand)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    p.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument(
        "--prompts-file",
        default=None,
        help="one prompt per line (.txt) or JSON lines with a 'prompt' field (.jsonl); used in "
        "order and cycled to --num-prompts; ignore_eos is not set for these",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no cap)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second with Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of the results here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` parsed as `pagedserve bench serve` parses it (for callers that run it in-process)."""
    parser = argparse.ArgumentParser(prog="pagedserve bench serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.input_len < 1:
        raise ValueError(f"--input-len must be at least 1, got {args.input_len}")
    if args.output_len < 1:
        raise ValueError(f"--output-len must be at least 1, got {args.output_len}")
    if math.isnan(args.request_rate) or args.request_rate <= 0:
        raise ValueError(
            f"--request-rate must be a positive number of requests per second (or inf to send "
            f"all at once), got {args.request_rate}"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(
            f"--max-concurrency must be at least 1 (omit it for no cap), got {args.max_concurrency}"
        )
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"--endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {args.endpoint}")


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


def random_token_ids(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """`num_prompts` lists of `input_len` ids drawn uniformly from [TOKEN_ID_LOW, TOKEN_ID_HIGH)
    with `random.Random(seed)`: the same seed gives the same prompts on every machine."""
    rng = random.Random(seed)
    return [
        [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(input_len)]
        for _ in range(num_prompts)
    ]


def read_prompts_file(path: str | Path, num_prompts: int) -> list[str]:
    """Prompts from a text file (one per non-blank line) or a .jsonl file (a JSON object with a
    string "prompt" on each non-blank line), in file order, cycled to `num_prompts`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts-file {path} does not exist (or is not a file)")
    prompts: list[str] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f'{path}:{lineno}: expected an object with a string "prompt"')
                prompts.append(obj["prompt"])
            else:
                # Only the line break goes: leading and trailing spaces are part of the prompt.
                prompts.append(line.rstrip("\r\n"))
    if not prompts:
        raise ValueError(f"--prompts-file {path} holds no prompts (it is empty or all blank)")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def poisson_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds between successive arrivals of a Poisson process of `request_rate` per second:
    exponential gaps with mean 1/rate from `random.Random(seed)`; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num_requests)]


def arrival_times(gaps: Sequence[float]) -> list[float]:
    """Send time of each request, in seconds from the start of the benchmark. The first request
    goes at 0 (as in vLLM), so no idle wait before it counts in the benchmark duration; request i
    follows request i-1 by gaps[i-1], and the last gap is unused."""
    times = [0.0] * len(gaps)
    for i in range(1, len(gaps)):
        times[i] = times[i - 1] + gaps[i - 1]
    return times


def build_request(
    endpoint: str, model: str, prompt: str | list[int], output_len: int, ignore_eos: bool
) -> tuple[str, dict[str, Any]]:
    """The URL path and JSON body of one streaming request with greedy sampling."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs text prompts; detokenize the ids first")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(
        max_tokens=output_len,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        # Not an OpenAI field; our server (like vLLM) accepts it so every request yields exactly
        # max_tokens tokens and the workload does not depend on what the model says.
        body["ignore_eos"] = True
    return ENDPOINT_PATHS[endpoint], body


# ---------------------------------------------------------------------------------------------
# Running against a server
# ---------------------------------------------------------------------------------------------


def _normalise_base_url(url: str) -> str:
    # OpenAI clients take ".../v1" as their base URL; /tokenize and /detokenize live at the root.
    url = url.rstrip("/")
    return url.removesuffix("/v1")


async def _setup_call(
    client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    """One setup request (not timed); every way it can fail becomes an actionable ValueError."""
    url = f"{client.base_url}{path}"
    try:
        resp = await client.request(method, path, json=body)
    except httpx.TransportError as e:
        raise ValueError(
            f"cannot reach the server at {url} ({type(e).__name__}: {e}); start one with "
            f"`pagedserve serve --model ...` or pass its address with --base-url"
        ) from None
    if resp.status_code != 200:
        hint = " (check --api-key)" if resp.status_code in (401, 403) else ""
        raise ValueError(
            f"{method} {url} returned HTTP {resp.status_code}{hint}: {resp.text[:500]}"
        )
    try:
        return resp.json()
    except ValueError:
        raise ValueError(f"{method} {url} did not return JSON: {resp.text[:200]!r}") from None


async def _send(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    endpoint: str,
    t0: float,
    timeout: float,
) -> RequestRecord:
    """Send one streaming request and time it; never raises (failures are in the record)."""
    recorder = StreamRecorder(endpoint, start=time.perf_counter() - t0)
    error = ""
    try:
        # httpx's timeout bounds each read; this one bounds the whole request.
        async with asyncio.timeout(timeout):
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", errors="replace")
                    error = f"HTTP {resp.status_code}: {text[:500]}"
                else:
                    async for data in resp.aiter_bytes():
                        recorder.feed(data, time.perf_counter() - t0)
    except TimeoutError:
        error = f"timed out after {timeout:g} s"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return recorder.finish(time.perf_counter() - t0, error)


async def _max_model_len(client: httpx.AsyncClient, model: str) -> int | None:
    """The served model's max_model_len from GET /v1/models; None when its card has none."""
    models = await _setup_call(client, "GET", "/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    for card in cards or []:
        if isinstance(card, dict) and card.get("id") == model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) else None
    return None


async def _prepare_prompts(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str
) -> tuple[list[str] | list[list[int]], bool]:
    """The prompts to send, and whether to set ignore_eos."""
    if args.prompts_file:
        return read_prompts_file(args.prompts_file, args.num_prompts), False
    # A workload that cannot fit fails here with a clear message instead of as num_prompts HTTP
    # 400s. The model card carries max_model_len (ours and vLLM's) and, unlike /tokenize, needs
    # no tokenizer: token-id prompts work against a model served without one.
    max_model_len = await _max_model_len(client, model)
    if max_model_len is not None and args.input_len + args.output_len > max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the server's "
            f"max_model_len {max_model_len}; lower them or serve with a larger --max-model-len"
        )
    ids = random_token_ids(args.num_prompts, args.input_len, args.seed)
    if args.endpoint == "completions":
        return ids, True
    # Chat takes text: the ids become text once, before timing starts. The chat template adds
    # tokens and re-tokenising need not give back the same ids, so prompt_tokens (from usage)
    # will not be exactly input_len for chat.
    outs = await asyncio.gather(
        *(_setup_call(client, "POST", "/detokenize", {"model": model, "tokens": p}) for p in ids)
    )
    return [o["prompt"] for o in outs], True


async def _benchmark(args: argparse.Namespace) -> tuple[str, list[RequestRecord], float]:
    base_url = _normalise_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # One connection per request that may be in flight, so the pool never queues a request and
    # adds its wait to TTFT.
    num_connections = max(args.num_prompts, 100)
    limits = httpx.Limits(
        max_connections=num_connections, max_keepalive_connections=num_connections
    )
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = args.model
        if model is None:
            models = await _setup_call(client, "GET", "/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            if not data:
                raise ValueError(f"GET {base_url}/v1/models lists no models; pass --model")
            model = data[0]["id"]
        prompts, ignore_eos = await _prepare_prompts(client, args, model)
        requests = [
            build_request(args.endpoint, model, p, args.output_len, ignore_eos) for p in prompts
        ]

        # A short test request first: a wrong model name, a missing route or an unsupported
        # field fails once with its message instead of num_prompts times.
        path, body = requests[0]
        probe_body = {**body, "max_tokens": min(args.output_len, 4)}
        probe = await _send(
            client, path, probe_body, args.endpoint, time.perf_counter(), args.timeout
        )
        if not probe.success:
            raise ValueError(f"the test request to {base_url}{path} failed: {probe.error}")

        from tqdm import tqdm

        arrivals = arrival_times(poisson_gaps(args.num_prompts, args.request_rate, args.seed))
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        progress = tqdm(total=args.num_prompts, desc="requests", disable=None)

        async def one(i: int) -> RequestRecord:
            # Wait for the arrival time first, then for a concurrency slot: a capped run queues
            # requests the way a busy client would.
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                record = await _send(client, *requests[i], args.endpoint, t0, args.timeout)
            progress.update(1)
            return record

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i) for i in range(args.num_prompts)))
        duration = time.perf_counter() - t0
        progress.close()
    return model, list(records), duration


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args` (from `add_arguments`), print the report, write the
    JSON and PNG if asked, and return the result dict (configuration, summary, per-request lists).

    Raises ValueError with a message a person can act on for bad arguments or an unusable server.
    Starts its own event loop, so call it from synchronous code.
    """
    _validate(args)
    if args.prompts_file:
        read_prompts_file(args.prompts_file, args.num_prompts)  # file errors before any network
    model, records, duration = asyncio.run(_benchmark(args))
    summary = summarize(records, duration)
    config = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": _normalise_base_url(args.base_url),
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": None if args.prompts_file else args.input_len,
        "output_len": args.output_len,
        "prompts_file": args.prompts_file,
        "max_concurrency": args.max_concurrency,
        # JSON has no infinity; vLLM writes the string "inf" too.
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "seed": args.seed,
    }

    print(format_report(summary, config))
    failures = [(i, r.error) for i, r in enumerate(records) if not r.success]
    for i, error in failures[:NUM_FAILURES_SHOWN]:
        print(f"request {i} failed: {error}")
    if len(failures) > NUM_FAILURES_SHOWN:
        print(f"... and {len(failures) - NUM_FAILURES_SHOWN} more failures")
    if not args.prompts_file:
        short = sum(1 for r in records if r.success and r.completion_tokens != args.output_len)
        if short:
            print(
                f"warning: {short} requests generated other than --output-len {args.output_len} "
                f"tokens despite ignore_eos; token throughput is not comparable across runs"
            )

    result = {**config, **summary, **per_request_lists(records)}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot_path:
        plot_results(records, summary, args.plot_path)
    return result
