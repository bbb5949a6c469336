"""`pagedserve serve --data-parallel-size 2`: two engine cores (processes with their own KV cache)
behind one server of the embedded SmolLM2, started once for the module. Concurrent requests are
spread over both cores; a repeated long prefix goes back to the core that cached it (seen in the
per-core /metrics series); /v1/kv takes ?engine=i; and, last, a core killed mid-stream takes the
whole server down as a single core does. Flags that cannot work together are refused at once."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.server.cli import main
from tests.helpers import child_pids, process_alive
from tests.server.test_core_process import Server, _server
from tests.server.util import sse_events

MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16  # the default --block-size


class DPServer(Server):
    @property
    def core_pids(self) -> list[int]:
        """From the startup line: "... 2 engine cores in processes 123, 456"."""
        found = re.search(r"2 engine cores in processes (\d+), (\d+)", self.log())
        assert found, self.log()
        return [int(found.group(1)), int(found.group(2))]

    def complete(self, prompt, max_tokens: int, **fields) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, **fields}  # fmt: skip
        r = httpx.post(f"{self.base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def per_engine(self, name: str) -> dict[str, float]:
        """The samples of a family labelled by engine: {"0": value, "1": value}."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        found = {}
        for line in text.splitlines():
            match = re.fullmatch(rf'{name}\{{engine="(\d+)"\}} (\S+)', line)
            if match:
                found[match.group(1)] = float(match.group(2))
        assert set(found) == {"0", "1"}, f"{name} per engine not in /metrics:\n{text}"
        return found

    def wait_per_engine(self, name: str, want: dict[str, float], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (got := self.per_engine(name)) != want:
            assert time.monotonic() < deadline, f"{name}: {got}, waiting for {want}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory) -> Iterator[DPServer]:
    """The server in a session of its own, killed at the end whatever the tests did to it."""
    folder = tmp_path_factory.mktemp("dp-server")
    with _server(folder, "--data-parallel-size", "2") as server:
        yield DPServer(server.proc, server.base, server.log_path)


def test_concurrent_requests_are_served_by_both_cores(dp_server):
    steps = dp_server.per_engine("pagedserve_engine_steps_total")
    # Prompts that differ in their first block: nothing cached to prefer, so the load decides.
    requests = [(f"{i} bottles of water on the wall, and then", 4 + i % 5) for i in range(32)]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: dp_server.complete(*r), requests))
    for (_, max_tokens), answer in zip(requests, answers, strict=True):
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == max_tokens
        assert answer["choices"][0]["text"]
    after = dp_server.per_engine("pagedserve_engine_steps_total")
    assert all(after[e] > steps[e] for e in ("0", "1")), (steps, after)
    # Both cores are idle again, each pool whole, and each process's memory is reported.
    dp_server.wait_per_engine("pagedserve_num_requests_running", {"0": 0, "1": 0})
    dp_server.wait_per_engine("pagedserve_kv_blocks_used", {"0": 0, "1": 0})
    totals = dp_server.per_engine("pagedserve_kv_blocks_total")
    assert totals["0"] == totals["1"] > 0
    text = httpx.get(f"{dp_server.base}/metrics", timeout=10).text
    for engine in ("0", "1"):
        assert f'pagedserve_resident_memory_bytes{{engine="{engine}",process="core"}}' in text
    assert "\npagedserve_kv_blocks_used " not in text  # no unlabelled sample beside them


def test_a_repeated_prefix_goes_back_to_the_core_that_cached_it(dp_server):
    text = "The history of the lighthouse keepers of the northern coast is long. " * 40
    ids = httpx.post(
        f"{dp_server.base}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30
    ).json()["tokens"]
    prefix = ids[:300]
    repetitions = 3
    hits_per_repetition = 300 // BLOCK_SIZE * BLOCK_SIZE  # 288: the suffix starts in block 18
    hits = dp_server.per_engine("pagedserve_prefix_cache_hits_total")

    def prefixed(i: int) -> list[int]:  # suffixes that differ from their first token on
        return prefix + [5000 + 10 * i, 5001 + 10 * i, 5002 + 10 * i]

    # A long stream keeps core 0 busy (idle cores tie: the lowest index wins), so the prefix's
    # first request goes to core 1, the less loaded ...
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{dp_server.base}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # (kept: a dropped iterator would close the stream)
        next(line for line in lines if line.startswith("data: "))
        assert dp_server.per_engine("pagedserve_num_requests_running") == {"0": 1, "1": 0}
        dp_server.complete(prefixed(0), 2)
    # ... and once it has ended, both cores are idle again: only the cached prefix tells core 1
    # from core 0. Short prompts (no full block, so no hits) go to core 0 in between.
    dp_server.wait_per_engine("pagedserve_num_requests_running", {"0": 0, "1": 0})
    for i in range(1, repetitions + 1):
        dp_server.complete(prefixed(i), 2)
        dp_server.complete(f"Say {i}.", 2)
    after = dp_server.per_engine("pagedserve_prefix_cache_hits_total")
    assert after["1"] - hits["1"] == repetitions * hits_per_repetition
    assert after["0"] == hits["0"]


def test_kv_map_per_engine(dp_server):
    for engine in (0, 1):
        r = httpx.get(f"{dp_server.base}/v1/kv", params={"engine": engine}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["num_blocks"] > 0
    default = httpx.get(f"{dp_server.base}/v1/kv", timeout=30)
    assert default.status_code == 200 and default.json()["num_blocks"] > 0
    r = httpx.get(f"{dp_server.base}/v1/kv", params={"engine": 5}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "engine 5 does not exist: this server has 2 engine cores (0 to 1)",
            "type": "invalid_request_error",
            "param": "engine",
            "code": None,
        }
    }


def test_data_parallel_needs_the_core_process(capsys):
    assert main(["serve", "--no-core-process", "--data-parallel-size", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: --data-parallel-size 2 runs each engine core in a process of its own: drop "
        "--no-core-process\n"
    )
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert capsys.readouterr().err == "error: --data-parallel-size must be >= 1, got 0\n"


# Last: it takes the module's server down.
def test_a_dead_core_ends_every_stream_and_the_server(dp_server):
    pids = dp_server.core_pids
    assert set(pids) <= set(child_pids(dp_server.proc.pid))
    body = {"model": MODEL, "prompt": "Count from one to a thousand:", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}  # fmt: skip

    def stream(started) -> tuple[str, httpx.TransportError | None]:
        chunks = []
        try:
            with httpx.stream("POST", f"{dp_server.base}/v1/completions", json=body,
                              timeout=120) as r:  # fmt: skip
                for chunk in r.iter_text():
                    chunks.append(chunk)
                    started.set()
        except httpx.TransportError as e:
            return "".join(chunks), e
        return "".join(chunks), None

    with ThreadPoolExecutor(2) as pool:
        # One stream on each core: the second goes to the less loaded one.
        events = [threading.Event(), threading.Event()]
        first = pool.submit(stream, events[0])
        assert events[0].wait(60)
        dp_server.wait_per_engine("pagedserve_num_requests_running", {"0": 1, "1": 0})
        second = pool.submit(stream, events[1])
        assert events[1].wait(60)
        dp_server.wait_per_engine("pagedserve_num_requests_running", {"0": 1, "1": 1})
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        statuses = set()
        while dp_server.proc.poll() is None:
            statuses.add(dp_server.health())
            time.sleep(0.02)
        exited = time.monotonic() - killed
        bodies = [first.result(60), second.result(60)]
    assert dp_server.proc.returncode == 1
    assert exited < 10
    assert 503 in statuses
    for text, error in bodies:
        assert error is None
        events = sse_events(httpx.Response(200, text=text))
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert events[-1]["error"]["code"] == "engine_dead"
        assert "exited with code -9" in events[-1]["error"]["message"]
    assert "the server stops because the engine failed" in dp_server.log()
    deadline = time.monotonic() + 15
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(p) for p in pids)
