"""Prometheus metrics (`GET /metrics`), named `pagedserve_*`, and beside them vLLM's `vllm:*` names
for Kubernetes routers and vLLM's dashboards (server/metrics/vllm_metrics.py).

Three sources:
- engine state (requests running/waiting, KV blocks, preemptions, prefix-cache counters) is read
  at scrape time from the EngineStats snapshot the engine thread publishes after every iteration,
  so a scrape never waits for a step and always shows the state after the latest abort;
- per-request latencies and token counters are recorded by the HTTP handlers as snapshots arrive
  (`RequestMetrics`), i.e. as the client sees them, queueing in the server included;
- the resident memory of the API server's process and, when the engine core runs in its own
  process, of that one (`pagedserve_resident_memory_bytes{process="server"|"core"}`), read from
  /proc at scrape time (Linux only: elsewhere the samples are left out).

With several engine cores (`--data-parallel-size M`, engine/frontend/data_parallel.py) every
engine-state family is labelled `engine="0"`..`"M-1"`, one sample per core (sum them for the server:
`sum(pagedserve_kv_blocks_used)`), and each core's memory is `{process="core", engine="i"}`.
With one core the families stay unlabelled, as they always were, so that a scrape of a
single-core server reads the same; a family never mixes labelled and unlabelled samples.

Each app owns its registry (no module-level state), so several apps can live in one process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.frontend.outputs import RequestOutput
from pagedserve.engine.messages import EngineStats
from pagedserve.scheduler import LoRARequest
from pagedserve.server.metrics.engine_families import ENGINE_FAMILIES
from pagedserve.server.metrics.vllm_metrics import VLLMCollector

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class _EngineCollector(Collector):
    """The engine-state families: one unlabelled sample each, or with several engine cores one
    sample per core, labelled `engine="0"`... (their sum is the whole server's)."""

    def __init__(
        self,
        read_stats: Callable[[], EngineStats],
        read_core_stats: Callable[[], Sequence[EngineStats]] | None,
    ) -> None:
        self._read_stats = read_stats
        self._read_core_stats = read_core_stats

    def collect(self) -> Iterator[Metric]:
        cores = list(self._read_core_stats()) if self._read_core_stats is not None else []
        per_core = len(cores) > 1
        stats = cores if per_core else [self._read_stats()]
        for family in ENGINE_FAMILIES:
            name = f"pagedserve_{family.name}"
            if not per_core:
                yield family.kind(name, family.doc, value=family.read(stats[0]))
                continue
            metric = family.kind(name, family.doc, labels=["engine"])
            for index, s in enumerate(stats):
                metric.add_metric([str(index)], family.read(s))
            yield metric


class _LoRACollector(Collector):
    """`pagedserve_lora_slot_loads`: the adapters copied into device slots so far (the slots'
    churn), all cores. Nothing while the engine serves no adapters."""

    def __init__(self, read_core_stats: Callable[[], Sequence[EngineStats]]) -> None:
        self._read_core_stats = read_core_stats

    def collect(self) -> Iterator[Metric]:
        cores = [s for s in self._read_core_stats() if s.max_loras]
        if cores:
            yield CounterMetricFamily(
                "pagedserve_lora_slot_loads",
                "LoRA adapters copied into a device slot (all cores)",
                value=sum(s.lora_slot_loads for s in cores),
            )


def resident_memory_bytes(pid: int) -> int | None:
    """Resident set size of process `pid` in bytes (/proc/PID/statm: resident pages x page
    size); None where /proc is unavailable or the process is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _MemoryCollector(Collector):
    """`pagedserve_resident_memory_bytes`, one sample per process: "server" (this one) and
    "core" (the engine core's, while `core_pids` returns one), or with several engine cores
    `process="core", engine="i"` for each."""

    def __init__(self, core_pids: Callable[[], Sequence[int | None]]) -> None:
        self._core_pids = core_pids

    def collect(self) -> Iterator[Metric]:
        name = "pagedserve_resident_memory_bytes"
        family = Metric(
            name,
            "Resident memory (RSS) of the API server's process and of the engine core's",
            "gauge",
        )
        core_pids = list(self._core_pids())
        pids = [({"process": "server"}, os.getpid())]
        if len(core_pids) == 1:
            pids.append(({"process": "core"}, core_pids[0]))
        else:
            pids += [({"process": "core", "engine": str(i)}, p) for i, p in enumerate(core_pids)]
        for labels, pid in pids:
            rss = resident_memory_bytes(pid) if pid is not None else None
            if rss is not None:
                family.add_sample(name, labels, rss)
        if family.samples:
            yield family


class Metrics:
    """The registry of one server and the per-request instruments.

    `read_stats` returns the whole engine's stats. `read_core_stats`, when given, each core's
    (EngineClient.core_stats): with more than one, the engine-state families get an `engine`
    label, one sample per core, instead of the single unlabelled one.
    `core_pid` returns the id of the engine core's process when the core runs in one of its own
    (ProcessEngine.pid), else None; `core_pids` (EngineClient.core_pids), when given, the ids of
    every core's instead. Without either only the server's memory is reported. `model_name`:
    the `model_name` label of the vLLM-named families (the first served name)."""

    def __init__(
        self,
        read_stats: Callable[[], EngineStats],
        core_pid: Callable[[], int | None] = lambda: None,
        read_core_stats: Callable[[], Sequence[EngineStats]] | None = None,
        core_pids: Callable[[], Sequence[int | None]] | None = None,
        model_name: str = "",
    ) -> None:
        if core_pids is None:
            core_pids = lambda: [core_pid()]  # noqa: E731
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(read_stats, read_core_stats))
        self.registry.register(_MemoryCollector(core_pids))
        all_stats = read_core_stats or (lambda: [read_stats()])
        self.registry.register(_LoRACollector(all_stats))
        r = self.registry

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(f"pagedserve_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"pagedserve_{name}", doc, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (all samples)")
        self.requests_finished = counter(
            "request_success", "Requests finished, by finish reason of their first sample",
            ["finish_reason"],
        )  # fmt: skip
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "From the request's arrival to its first generated token", _LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between successive tokens of a sample",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.lora_requests = counter(
            "lora_requests", "Engine requests accepted per LoRA adapter", ["lora_name"]
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From the request's arrival to its last token",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        instruments = (
            ("vllm:prompt_tokens", self.prompt_tokens),
            ("vllm:generation_tokens", self.generation_tokens),
            ("vllm:request_success", self.requests_finished),
            ("vllm:time_to_first_token_seconds", self.ttft),
            ("vllm:inter_token_latency_seconds", self.itl),
            ("vllm:e2e_request_latency_seconds", self.e2e),
        )
        r.register(VLLMCollector(model_name, all_stats, instruments))

    def track(
        self, num_prompt_tokens: int, arrival: float | None = None, lora: LoRARequest | None = None
    ) -> RequestMetrics:
        """Start recording one engine request (arrival in time.monotonic() seconds) of adapter
        `lora` (None: the base model)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        if lora is not None:
            self.lora_requests.labels(lora_name=lora.lora_name).inc()
        return RequestMetrics(self, time.monotonic() if arrival is None else arrival)


class RequestMetrics:
    """Turns the delta outputs of one request into TTFT / ITL / E2E observations."""

    __slots__ = (
        "_m",
        "_arrival",
        "_last_token_time",
        "_longest",
        "_total",
        "_counts",
        "_reason",
        "_done",
    )

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last_token_time: float | None = None
        self._longest = 0  # tokens of the longest sample so far: the ITL clock follows it
        self._total = 0  # tokens of all samples so far
        self._counts: dict[int, int] = {}  # sample index -> its tokens so far
        self._reason: str | None = None  # sample 0's finish reason, once it has one
        self._done = False

    def update(self, output: RequestOutput) -> None:
        if self._done:
            return
        now = time.monotonic()
        # Outputs are deltas: count each sample's tokens so far.
        for c in output.outputs:
            self._counts[c.index] = self._counts.get(c.index, 0) + len(c.token_ids)
            if c.index == 0 and c.finish_reason is not None:
                self._reason = c.finish_reason
        counts = self._counts.values()
        total = sum(counts)
        if total > self._total:
            self._m.generation_tokens.inc(total - self._total)
            self._total = total
        longest = max(counts, default=0)
        new = longest - self._longest
        if new > 0:
            if self._last_token_time is None:
                self._m.ttft.observe(now - self._arrival)
                new -= 1
            else:
                # Several tokens in one output (the reader fell behind a step or more): spread
                # the gap over them so the histogram still counts one observation per token.
                gap = (now - self._last_token_time) / new
                for _ in range(new):
                    self._m.itl.observe(gap)
            self._last_token_time = now
            self._longest = longest
        if output.finished:
            self._done = True
            self._m.e2e.observe(now - self._arrival)
            self._m.requests_finished.labels(finish_reason=self._reason or "abort").inc()
