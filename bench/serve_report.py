"""`bench serve`'s results: the statistics of a run (latencies in milliseconds), the result table
laid out like `vllm bench serve`'s, the per-request lists of the JSON, and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.bench.serve_stream import RequestRecord

# Percentiles reported for every latency metric (besides the mean).
PERCENTILES: tuple[tuple[str, float], ...] = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
METRICS: tuple[tuple[str, str, str], ...] = (
    # (key, short name, section title) in report order
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
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
