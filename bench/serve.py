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
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

# Random prompts draw ids from this range. The server does not expose its vocabulary size, and
# ids below ~1000 hold bytes and special tokens in most BPE vocabularies, so [1000, 10000) is a
# safe range of ordinary tokens for any vocabulary of at least 10k entries.
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 10000

# Percentiles reported for every latency metric (besides the mean).
PERCENTILES: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
METRICS: tuple[tuple[str, str, str], ...] = (
    # (key, short name, section title) in report order
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
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
# Streaming responses
# ---------------------------------------------------------------------------------------------


class SSEDecoder:
    """Incremental Server-Sent Events decoder: feed it bytes as they arrive, get back the data
    of every event completed so far.

    An event ends at a blank line. Bytes are kept until their event is complete, so a multi-byte
    UTF-8 character or a line split across network chunks is decoded whole. Multiple `data:`
    lines of one event are joined by newlines; comments (`:`) and other fields are ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Append `chunk` and return the data of each event it completes, in order."""
        # Normalising on the whole buffer also joins a "\r" at the end of one chunk with the
        # "\n" that starts the next.
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        *complete, self._buffer = self._buffer.split(b"\n\n")
        events = []
        for raw in complete:
            data_lines = []
            for line in raw.decode("utf-8", errors="replace").split("\n"):
                if line.startswith("data:"):
                    value = line[len("data:") :]
                    data_lines.append(value[1:] if value.startswith(" ") else value)
            if data_lines:
                events.append("\n".join(data_lines))
        return events


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start` is from the start of the benchmark.

    Invariant for a successful request: at least one text chunk arrived (so `ttft` is its time
    after `start`), `itls` holds the gaps between successive text chunks (one fewer than the
    chunks), and the token counts come from the stream's usage chunk.
    """

    success: bool
    start: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    def text_chunk_times(self) -> list[float]:
        """Arrival time of each text chunk, in seconds from the start of the benchmark."""
        t = self.start + self.ttft
        times = [t]
        for gap in self.itls:
            t += gap
            times.append(t)
        return times


def chunk_text(payload: dict[str, Any], endpoint: str) -> str:
    """The generated text a streamed chunk carries ("" for role-only and usage-only chunks)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        # The first chat chunk may be {"role": "assistant"} alone; it is not a token.
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class StreamRecorder:
    """Turns the bytes of one streaming response, with their arrival times, into a RequestRecord.

    Kept free of I/O so the timing rules are testable: TTFT is the arrival of the first chunk
    carrying non-empty text, and every later text chunk adds one inter-token latency.
    """

    def __init__(self, endpoint: str, start: float) -> None:
        self.endpoint = endpoint
        self.start = start
        self._decoder = SSEDecoder()
        self._text_times: list[float] = []
        self._usage: dict[str, Any] | None = None
        self._error = ""
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        """Consume bytes that arrived at time `now` (seconds from the start of the benchmark)."""
        for event in self._decoder.feed(data):
            if self.done or self._error:
                continue
            if event.strip() == "[DONE]":
                self.done = True
                continue
            try:
                payload = json.loads(event)
            except json.JSONDecodeError:
                self._error = f"malformed stream event: {event[:200]!r}"
                continue
            if not isinstance(payload, dict):
                self._error = f"malformed stream event: {event[:200]!r}"
                continue
            if payload.get("error"):
                err = payload["error"]
                self._error = "error event: " + str(
                    err.get("message", err) if isinstance(err, dict) else err
                )
                continue
            if chunk_text(payload, self.endpoint):
                self._text_times.append(now)
            if payload.get("usage"):
                self._usage = payload["usage"]

    def finish(self, now: float, error: str = "") -> RequestRecord:
        """The record of the request, ended at `now`; `error` marks a transport failure."""
        error = error or self._error
        if not error and self._usage is None:
            error = (
                "the stream ended without a usage chunk (is stream_options.include_usage honoured?)"
            )
        if not error and not self._text_times:
            error = "the stream carried no text"
        if error:
            return RequestRecord(
                success=False, start=self.start, e2el=now - self.start, error=error
            )
        assert self._usage is not None
        times = self._text_times
        return RequestRecord(
            success=True,
            start=self.start,
            ttft=times[0] - self.start,
            itls=[b - a for a, b in zip(times, times[1:], strict=False)],
            e2el=now - self.start,
            prompt_tokens=int(self._usage.get("prompt_tokens", 0)),
            completion_tokens=int(self._usage.get("completion_tokens", 0)),
        )


# ---------------------------------------------------------------------------------------------
# Statistics and report
# ---------------------------------------------------------------------------------------------


def _stats(values_ms: Sequence[float], name: str) -> dict[str, float | None]:
    """Mean and percentiles (numpy, linear interpolation); None where there are no values."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values_ms, dtype=np.float64)
    out[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else None
    for label, q in PERCENTILES:
        out[f"{label}_{name}_ms"] = float(np.percentile(arr, q)) if arr.size else None
    return out


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, in seconds (vLLM's definition):
    (e2el - ttft) / (completion_tokens - 1); None when fewer than two tokens were generated."""
    if not record.success or record.completion_tokens <= 1:
        return None
    return (record.e2el - record.ttft) / (record.completion_tokens - 1)


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Throughput and latency statistics of a run that took `duration` seconds.

    Failed requests are counted in `failed` but contribute neither tokens nor latencies. ITL
    statistics pool the gaps of all successful requests; TPOT skips single-token requests.
    Statistics with no values (e.g. every request failed) are None.
    """
    if not duration > 0:
        raise ValueError(f"the benchmark duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.completion_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    summary |= _stats([r.ttft * 1000 for r in ok], "ttft")
    summary |= _stats([t * 1000 for t in tpots], "tpot")
    summary |= _stats([g * 1000 for r in ok for g in r.itls], "itl")
    summary |= _stats([r.e2el * 1000 for r in ok], "e2el")
    return summary


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def format_report(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """The result table, laid out like `vllm bench serve`'s."""
    width = 50

    def row(label: str, value: Any) -> str:
        return f"{label:<40} {_fmt(value)}"

    lines = [
        f"{' Serving Benchmark Result ':=^{width}}",
        row("Successful requests:", summary["completed"]),
        row("Failed requests:", summary["failed"]),
        row("Maximum request concurrency:", config.get("max_concurrency") or "unlimited"),
        row("Request rate configured (RPS):", config.get("request_rate")),
        row("Benchmark duration (s):", summary["duration"]),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Request throughput (req/s):", summary["request_throughput"]),
        row("Output token throughput (tok/s):", summary["output_throughput"]),
        row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, short, title in METRICS:
        lines.append(f"{title:-^{width}}")
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        for label, _ in PERCENTILES:
            shown = label.capitalize() if label == "median" else label.upper()
            lines.append(row(f"{shown} {short} (ms):", summary[f"{label}_{key}_ms"]))
    lines.append("=" * width)
    return "\n".join(lines)


def per_request_lists(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """Per-request values in submission order, for the JSON (seconds; None/[] where failed)."""
    return {
        "success": [r.success for r in records],
        "start_times": [r.start for r in records],
        "ttfts": [r.ttft if r.success else None for r in records],
        "itls": [list(r.itls) for r in records],
        "e2els": [r.e2el if r.success else None for r in records],
        "prompt_tokens": [r.prompt_tokens for r in records],
        "completion_tokens": [r.completion_tokens for r in records],
        "errors": [r.error for r in records],
    }


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


def output_tokens_over_time(
    records: Sequence[RequestRecord], duration: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """Output tokens/s per time bin: (bin starts, rates, bin width in s).

    A chunk may carry several tokens (or a partial UTF-8 character may hold text back), so each
    successful request's completion_tokens are spread evenly over its text chunks rather than
    counting chunks as tokens. Bins are 1 s wide for runs of 20 s or more, else duration / 20.
    """
    bin_s = 1.0 if duration >= 20 else max(duration / 20, 1e-3)
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.success:
            continue
        chunk_times = r.text_chunk_times()
        times += chunk_times
        weights += [r.completion_tokens / len(chunk_times)] * len(chunk_times)
    end = max([duration, *times])
    edges = np.arange(0.0, end + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s, bin_s


def plot_results(
    records: Sequence[RequestRecord], summary: dict[str, Any], path: str | Path
) -> None:
    """Write a PNG with histograms of TTFT, TPOT and ITL, and output tokens/s over time."""
    # The object-oriented API with an explicit Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in records if r.success]
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    hists = [
        (axes[0][0], [r.ttft * 1000 for r in ok], "TTFT (ms)", summary["median_ttft_ms"]),
        (
            axes[0][1],
            [t * 1000 for t in map(tpot, ok) if t is not None],
            "TPOT (ms)",
            summary["median_tpot_ms"],
        ),
        (axes[1][0], [g * 1000 for r in ok for g in r.itls], "ITL (ms)", summary["median_itl_ms"]),
    ]
    for ax, values, label, median in hists:
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(10, len(values) // 4)))
        ax.axvline(median, color="black", linestyle="--", label=f"median {median:.2f} ms")
        ax.legend()

    ax = axes[1][1]
    starts, rates, bin_s = output_tokens_over_time(records, summary["duration"])
    ax.step(starts, rates, where="post")
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"in {bin_s:.3g} s bins; each request's usage tokens spread over its text chunks",
        fontsize="medium",
    )
    ax.axhline(summary["output_throughput"], color="black", linestyle="--", label="mean")
    ax.legend()

    fig.suptitle(
        f"{summary['completed']} ok, {summary['failed']} failed in {summary['duration']:.2f} s | "
        f"{summary['request_throughput']:.2f} req/s | "
        f"{summary['output_throughput']:.1f} output tok/s | "
        f"median TTFT {_fmt(summary['median_ttft_ms'])} ms | "
        f"median TPOT {_fmt(summary['median_tpot_ms'])} ms"
    )
    fig.savefig(path, format="png", dpi=100)


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
