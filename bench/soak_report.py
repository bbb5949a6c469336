"""The verdict of `bench soak`: the server's state as /metrics reports it, and the report built
from the outcomes and that state, with its checks (failed requests, KV blocks held, requests left,
memory growth)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench.serve_report import _fmt, _stats
from pagedserve.bench.soak_requests import (
    COMPLETED_BEFORE_DROP,
    DISCONNECTED,
    FAILED,
    INVALID_AS_EXPECTED,
    INVALID_KINDS,
    OK,
    OUTCOMES,
    Outcome,
)

KV_BLOCKS_USED = "pagedserve_kv_blocks_used"
KV_BLOCKS_TOTAL = "pagedserve_kv_blocks_total"
NUM_RUNNING = "pagedserve_num_requests_running"
NUM_WAITING = "pagedserve_num_requests_waiting"
RESIDENT_MEMORY = "pagedserve_resident_memory_bytes"
ENGINE_GAUGES = (NUM_RUNNING, NUM_WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)  # ServerSnapshot order
MIB = 1024 * 1024


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
