"""The engine-state families of `GET /metrics`: each reads one EngineStats value at scrape time
and goes by pagedserve's name (`pagedserve_*`) and, where vLLM has the family, by vLLM's name
too (`vllm:*`, server/metrics/vllm_metrics.py), so that the two always agree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.engine.messages import EngineStats

GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily


@dataclass(frozen=True)
class EngineFamily:
    """One family: a gauge or a counter, its name and help, and the value it reads."""

    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    name: str  # pagedserve_<name>
    read: Callable[[EngineStats], float]
    doc: str
    vllm: tuple[str, str] | None = None  # vLLM's name (vllm:<name>) and help, where vLLM has it


ENGINE_FAMILIES = (
    EngineFamily(GAUGE, "num_requests_running", lambda s: s.num_running,
                 "Sequences in the running batch",
                 vllm=("num_requests_running", "Number of requests in model execution batches")),
    EngineFamily(GAUGE, "num_requests_waiting", lambda s: s.num_waiting,
                 "Sequences waiting to be admitted",
                 vllm=("num_requests_waiting", "Number of requests waiting to be processed")),
    EngineFamily(GAUGE, "kv_blocks_used", lambda s: s.kv_blocks_used,
                 "KV-cache blocks held by live requests"),
    EngineFamily(GAUGE, "kv_blocks_total", lambda s: s.kv_blocks_total,
                 "KV-cache blocks in the pool"),
    EngineFamily(GAUGE, "kv_cache_usage", lambda s: s.kv_usage,
                 "Fraction of KV-cache blocks in use (0-1)",
                 vllm=("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage")),
    EngineFamily(GAUGE, "kv_host_blocks_used", lambda s: s.kv_host_blocks_used,
                 "Swap preemption: host-pool blocks holding swapped KV"),
    EngineFamily(GAUGE, "kv_host_blocks_total", lambda s: s.kv_host_blocks_total,
                 "Swap preemption: blocks in the host pool (0: recompute)"),
    EngineFamily(COUNTER, "num_preemptions", lambda s: s.num_preemptions,
                 "Requests preempted (swapped out or to recompute later)",
                 vllm=("num_preemptions", "Cumulative number of preemptions from the engine")),
    EngineFamily(COUNTER, "num_swap_outs", lambda s: s.num_swap_outs,
                 "Preemptions that moved the request's KV to the host pool"),
    EngineFamily(COUNTER, "num_swap_ins", lambda s: s.num_swap_ins,
                 "Swapped requests resumed with their KV moved back"),
    EngineFamily(COUNTER, "prefix_cache_queries", lambda s: s.prefix_cache_queries,
                 "Prompt tokens looked up in the prefix cache",
                 vllm=("prefix_cache_queries",
                       "Prefix cache queries, in terms of number of queried tokens")),
    EngineFamily(COUNTER, "prefix_cache_hits", lambda s: s.prefix_cache_hits,
                 "Prompt tokens found in the prefix cache",
                 vllm=("prefix_cache_hits",
                       "Prefix cache hits, in terms of number of cached tokens")),
    EngineFamily(COUNTER, "engine_steps", lambda s: s.num_steps,
                 "Engine steps run"),
    EngineFamily(COUNTER, "engine_step_seconds", lambda s: s.step_seconds,
                 "Time spent in engine steps"),
    EngineFamily(COUNTER, "spec_decode_draft_tokens", lambda s: s.spec_draft_tokens,
                 "Speculative decoding: draft tokens proposed"),
    EngineFamily(COUNTER, "spec_decode_accepted_tokens", lambda s: s.spec_accepted_tokens,
                 "Speculative decoding: draft tokens accepted"),
)  # fmt: skip
