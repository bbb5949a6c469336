"""vLLM's metric names in /metrics (server/metrics/vllm_metrics.py), as Kubernetes routers and
vLLM's dashboards read them: present, labelled as vLLM labels them, and equal to pagedserve's
own."""

from __future__ import annotations

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.messages import EngineStats
from pagedserve.server.metrics.pagedserve_metrics import Metrics
from tests.server.util import client

MODEL = "smollm2-135m-instruct"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_vllm_names_equal_pagedserves_own_on_the_real_server(server):
    completion = client(server).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    got = samples(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    engine = (("engine", "0"), ("model_name", MODEL))

    def own(name: str, labels: tuple = ()) -> float:
        return got[(f"pagedserve_{name}", labels)]

    assert got[("vllm:num_requests_running", engine)] == own("num_requests_running") == 0
    assert got[("vllm:num_requests_waiting", engine)] == own("num_requests_waiting") == 0
    assert got[("vllm:kv_cache_usage_perc", engine)] == own("kv_cache_usage") == 0.0
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert got[(f"vllm:{name}_total", engine)] == own(f"{name}_total")
    blocks = own("kv_blocks_total")
    info = (("block_size", "16"), ("engine", "0"), ("num_gpu_blocks", str(int(blocks))))
    assert got[("vllm:cache_config_info", info)] == 1.0
    model = (("model_name", MODEL),)
    prompt_tokens = got[("vllm:prompt_tokens_total", model)]
    assert prompt_tokens == own("prompt_tokens_total") >= completion.usage.prompt_tokens
    for name in (
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "time_to_first_token_seconds_sum",
        "e2e_request_latency_seconds_count",
        "inter_token_latency_seconds_count",
    ):
        assert got[(f"vllm:{name}", model)] == own(name) > 0
    stopped = (("finished_reason", "length"), ("model_name", MODEL))
    assert got[("vllm:request_success_total", stopped)] == own(
        "request_success_total", (("finish_reason", "length"),)
    )


def test_each_engine_core_is_a_sample_of_its_own():
    cores = [
        EngineStats(num_running=3, num_waiting=1, kv_blocks_used=25, kv_blocks_total=100,
                    block_size=16, prefix_cache_hits=64),
        EngineStats(num_running=1, num_waiting=0, kv_blocks_used=50, kv_blocks_total=100,
                    block_size=16, prefix_cache_hits=0),
    ]  # fmt: skip
    metrics = Metrics(lambda: cores[0], read_core_stats=lambda: cores, model_name="m")
    got = samples(generate_latest(metrics.registry).decode())
    for engine, (running, waiting, usage, hits) in enumerate([(3, 1, 0.25, 64), (1, 0, 0.5, 0)]):
        labels = (("engine", str(engine)), ("model_name", "m"))
        assert got[("vllm:num_requests_running", labels)] == running
        assert got[("vllm:num_requests_waiting", labels)] == waiting
        assert got[("vllm:kv_cache_usage_perc", labels)] == usage
        assert got[("vllm:prefix_cache_hits_total", labels)] == hits
    assert not any(name == "vllm:lora_requests_info" for name, _ in got)  # no adapters served
