"""vLLM's metric names beside pagedserve's own (`GET /metrics`): what Kubernetes routers read to
pick a pod (the Gateway API Inference Extension's endpoint picker, llm-d: queue depth, running
requests, KV-cache usage, loaded adapters, the cache's shape) and what dashboards made for vLLM
plot. Same sources as pagedserve's families, so the two always agree:

- engine state, one sample per engine core labelled as vLLM labels it (`model_name`, `engine`):
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a
  fraction, 1 = full, as in vLLM), the counters `vllm:num_preemptions`,
  `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (tokens), and
  `vllm:cache_config_info` (value 1; labels `block_size`, `num_gpu_blocks`: the pool's blocks,
  on a CPU too);
- `vllm:lora_requests_info` while adapters are served (its labels: the adapters of the running
  and of the waiting requests, `max_lora`; valued the scrape's time, as vLLM's);
- per-request counters and histograms re-read from pagedserve's own instruments under vLLM's
  names (`vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:request_success` by
  `finished_reason`, `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`), with `model_name` added.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from pagedserve.engine.messages import EngineStats
from pagedserve.server.metrics.engine_families import ENGINE_FAMILIES

# pagedserve's label names where vLLM's differ.
_LABELS = {"finish_reason": "finished_reason"}


class VLLMCollector(Collector):
    """The families above (the engine-state ones: those of ENGINE_FAMILIES with a vLLM name).
    `instruments`: (vLLM's name, pagedserve's counter or histogram)."""

    def __init__(
        self,
        model_name: str,
        read_core_stats: Callable[[], Sequence[EngineStats]],
        instruments: Sequence[tuple[str, MetricWrapperBase]],
    ) -> None:
        self._model_name = model_name
        self._read_core_stats = read_core_stats
        self._instruments = instruments

    def describe(self) -> list[Metric]:
        return []  # (no collect at registration: the engine may not be up yet)

    def collect(self) -> Iterator[Metric]:
        cores = list(self._read_core_stats())
        model = self._model_name
        labels = ["model_name", "engine"]
        for family in ENGINE_FAMILIES:
            if family.vllm is None:
                continue
            name, doc = family.vllm
            metric = family.kind(f"vllm:{name}", doc, labels=labels)
            for index, stats in enumerate(cores):
                metric.add_metric([model, str(index)], family.read(stats))
            yield metric
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache's configuration",
            labels=["block_size", "num_gpu_blocks", "engine"],
        )
        for index, stats in enumerate(cores):
            info.add_metric([str(stats.block_size), str(stats.kv_blocks_total), str(index)], 1)
        yield info
        yield from self._lora_info(cores)
        for name, instrument in self._instruments:
            for family in instrument.collect():
                renamed = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    sample_labels = {_LABELS.get(k, k): v for k, v in sample.labels.items()}
                    renamed.add_sample(
                        name + sample.name.removeprefix(family.name),
                        {"model_name": model, **sample_labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield renamed

    @staticmethod
    def _lora_info(cores: Sequence[EngineStats]) -> Iterator[Metric]:
        serving = [s for s in cores if s.max_loras]
        if not serving:
            return
        running = sorted({name for s in serving for name in s.running_loras})
        waiting = sorted({name for s in serving for name in s.waiting_loras})
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        max_lora = str(max(s.max_loras for s in serving))
        info.add_metric([",".join(running), ",".join(waiting), max_lora], time.time())
        yield info
