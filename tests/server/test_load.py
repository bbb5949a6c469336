"""Many clients at once, clients that go away, /metrics, and the `bench serve` load-test client,
against the real server process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai

from tests.server.util import PAGEDSERVE, client, metric, token_count

NUM_CLIENTS = 32
MAX_TOKENS = 12


def _prompt(i: int) -> str:
    return f"Question {i}: what is {i} plus {i + 1}? Answer:"


def test_32_concurrent_streams_equal_each_request_alone(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, list, object]:
        stream = await c.completions.create(
            model="smollm2-135m-instruct",
            prompt=_prompt(i),
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks, chunks[-1].usage

    async def all_at_once() -> list:
        c = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        async with c:
            return await asyncio.gather(*(one(c, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(all_at_once())
    sync = client(server)
    for i, (text, chunks, usage) in enumerate(results):
        # Well-formed: one id, text chunks with one choice, finish_reason on the last of them,
        # then the usage chunk.
        assert len({ch.id for ch in chunks}) == 1
        content = chunks[:-1]
        assert all(len(ch.choices) == 1 and ch.choices[0].index == 0 for ch in content)
        assert [ch.choices[0].finish_reason for ch in content][-1] == "length"
        assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
        assert chunks[-1].choices == []
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == token_count(server, prompt=_prompt(i))
        if i % 4:  # one in four, alone, against its text in the batch (the suite's time)
            continue
        alone = sync.completions.create(
            model="smollm2-135m-instruct",
            prompt=_prompt(i),
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert text == alone.choices[0].text, i
    assert metric(server, "pagedserve_kv_blocks_used") == 0


# A disconnected request's blocks are back within this many seconds: far less than its 1500
# tokens take, with room for a 2-core machine that runs other work beside the test.
ABORT_WITHIN = 3.0


def _wait_for_blocks(server, value: float, timeout: float) -> float:
    start = time.monotonic()
    while metric(server, "pagedserve_kv_blocks_used") != value:
        if time.monotonic() - start > timeout:
            raise AssertionError(
                f"kv_blocks_used still {metric(server, 'pagedserve_kv_blocks_used')} "
                f"after {timeout} s, expected {value}"
            )
        time.sleep(0.01)
    return time.monotonic() - start


def test_disconnected_stream_frees_its_blocks_within_a_second(server):
    before = metric(server, "pagedserve_kv_blocks_used")
    body = {
        "prompt": "Write a very long story.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.v1}/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(10):  # some tokens have been generated
                next(lines)
            assert metric(server, "pagedserve_kv_blocks_used") > before
            assert metric(server, "pagedserve_num_requests_running") == 1
        # Leaving the block closed the connection mid-stream.
    assert _wait_for_blocks(server, before, timeout=ABORT_WITHIN) < ABORT_WITHIN
    assert metric(server, "pagedserve_num_requests_running") == 0


def test_disconnected_non_streaming_request_is_aborted(server):
    before = metric(server, "pagedserve_kv_blocks_used")
    body = {"prompt": "Write a very long story.", "max_tokens": 1500, "ignore_eos": True}
    try:
        httpx.post(f"{server.v1}/completions", json=body, timeout=1.5)
        raise AssertionError("1500 tokens in 1.5 s on this CPU: the timeout should have fired")
    except httpx.ReadTimeout:
        pass
    assert _wait_for_blocks(server, before, timeout=ABORT_WITHIN) < ABORT_WITHIN
    assert metric(server, "pagedserve_num_requests_running") == 0


def test_metrics_count_tokens_and_latencies(server):
    names = (
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_count",
        "pagedserve_e2e_request_latency_seconds_count",
        "pagedserve_inter_token_latency_seconds_count",
    )
    before = {n: metric(server, n) for n in names}
    r = client(server).completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=7,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    after = {n: metric(server, n) for n in names}
    assert after["pagedserve_prompt_tokens_total"] - before["pagedserve_prompt_tokens_total"] == (
        r.usage.prompt_tokens
    )
    assert (
        after["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"]
        == r.usage.completion_tokens
        == 14
    )
    for n in names[2:4]:
        assert after[n] - before[n] == 1
    # One inter-token gap per token after the first, following the longest sample.
    itl = "pagedserve_inter_token_latency_seconds_count"
    assert after[itl] - before[itl] == 6
    total = metric(server, "pagedserve_kv_blocks_total")
    assert total == int(1 * 2**30 // (46080 * 16))  # --kv-cache-memory 1 GiB, 46080 B/token
    assert metric(server, "pagedserve_kv_cache_usage") == 0.0
    assert metric(server, "pagedserve_num_requests_waiting") == 0


def test_models_health_version(server):
    models = client(server).models.list()
    (card,) = models.data
    assert card.id == "smollm2-135m-instruct"
    assert card.model_extra["max_model_len"] == 2048
    assert client(server).models.retrieve("smollm2-135m-instruct").id == card.id
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    version = httpx.get(f"{server.base_url}/version").json()["version"]
    assert version and version[0].isdigit()


def test_bench_serve_against_the_server(server, tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    res = subprocess.run(
        [
            PAGEDSERVE,
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--num-prompts",
            "8",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--max-concurrency",
            "4",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    assert "Serving Benchmark Result" in res.stdout
    result = json.loads(out_json.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 32
    assert result["total_output_tokens"] == 8 * 8
    assert result["output_throughput"] > 0
    assert len(result["ttfts"]) == 8
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
