"""`pagedserve bench soak`: the whole command against the real server (mixed, partly invalid and
dropped requests; no failure, no block or memory left behind), the same command against a stub
server that fails in every way it checks, and the resident-memory gauge it reads.

Only tests/bench/ may import bench (tests/test_architecture.py), so the command runs here as a
user runs it, and its checks are exercised through a stub server rather than called directly."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest

from pagedserve.engine.messages import EngineStats
from pagedserve.server.metrics.pagedserve_metrics import Metrics, resident_memory_bytes
from tests.server.util import PAGEDSERVE

NUM_REQUESTS = 100
INVALID_FRACTION = 0.1
DISCONNECT_FRACTION = 0.2
# The invalid kinds bench/soak_requests.py rotates over, with the status each must get.
INVALID_KINDS = {
    "negative_token_id": 400,
    "token_id_beyond_vocab": 400,
    "max_tokens_over_context": 400,
    "negative_temperature": 400,
    "unknown_model": 404,
    "malformed_json": 400,
    "message_without_role": 400,
    "n_over_max": 400,
}


def _soak(base_url: str, out_json, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PAGEDSERVE, "bench", "soak", "--base-url", base_url, "--output-json", str(out_json),
         *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip


def test_soak_against_the_real_server(server, tmp_path):
    out_json = tmp_path / "soak.json"
    start = time.monotonic()
    res = _soak(
        server.base_url, out_json,
        "--num-requests", str(NUM_REQUESTS), "--concurrency", "16",
        "--disconnect-fraction", str(DISCONNECT_FRACTION),
        "--invalid-fraction", str(INVALID_FRACTION),
        "--max-input-len", "64", "--max-output-len", "16", "--seed", "1",
        timeout=600,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Soak Test Result" in res.stdout and "PASSED" in res.stdout, res.stdout
    result = json.loads(out_json.read_text())
    requests = result["requests"]
    assert len(requests) == result["num_requests"] == NUM_REQUESTS
    outcomes = result["outcomes"]

    # Every invalid request got its own status, in the OpenAI error shape.
    num_invalid = round(NUM_REQUESTS * INVALID_FRACTION)
    invalid = [r for r in requests if r["kind"] != "valid"]
    assert len(invalid) == sum(result["invalid"].values()) == num_invalid
    assert outcomes["invalid_as_expected"] == num_invalid
    assert {r["kind"] for r in invalid} == set(INVALID_KINDS)  # 10 requests rotate over all 8
    assert all(r["status"] == INVALID_KINDS[r["kind"]] for r in invalid)

    # Exactly the planned share of the valid streams was dropped, each mid-stream.
    valid_streams = [r for r in requests if r["kind"] == "valid" and r["stream"]]
    planned = round(len(valid_streams) * DISCONNECT_FRACTION)
    assert planned > 0
    assert result["planned_disconnects"] == planned == sum(r["planned_drop"] for r in requests)
    assert outcomes["disconnected"] == planned
    assert outcomes["completed_before_drop"] == 0
    assert all(r["events"] >= 1 for r in requests if r["result"] == "disconnected")

    # Everything else completed; nothing failed or was left behind.
    assert outcomes["failed"] == 0 and result["failures"] == {}
    assert outcomes["ok"] == NUM_REQUESTS - num_invalid - planned
    assert result["kv_blocks_used_end"] == 0
    assert result["num_requests_running_end"] == result["num_requests_waiting_end"] == 0
    # The memory check ran (the server and its engine-core process) under its own 10% limit.
    assert set(result["memory_before"]) == set(result["memory_after"]) == {"server", "core"}
    memory = next(c for c in result["checks"] if c["name"] == "memory growth")
    assert memory["passed"] is True, memory
    assert result["memory_growth"] <= 0.10
    assert result["passed"] is True
    assert result["output_tokens"] > 0 and result["p99_latency_ms"] >= result["median_latency_ms"]
    print(f"soak of {NUM_REQUESTS} requests: {elapsed:.1f} s")


# --- a server that fails every check -----------------------------------------------------------


class _FailingServer(BaseHTTPRequestHandler):
    """Lists one model; answers every completion with a 500; /metrics shows three KV blocks held
    and resident memory that doubles on every scrape."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the soak's client expects
    scrapes = 0

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            card = {"id": "stub", "object": "model", "max_model_len": 2048}
            self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
        elif self.path == "/metrics":
            type(self).scrapes += 1
            rss = 100_000_000 * 2**self.scrapes
            text = (
                "pagedserve_num_requests_running 0.0\n"
                "pagedserve_num_requests_waiting 0.0\n"
                "pagedserve_kv_blocks_used 3.0\n"
                "pagedserve_kv_blocks_total 100.0\n"
                f'pagedserve_resident_memory_bytes{{process="server"}} {rss}\n'
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
        self._send(500, json.dumps(body).encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def failing_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FailingServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_soak_fails_on_5xx_held_blocks_and_memory_growth(failing_server, tmp_path):
    out_json = tmp_path / "soak.json"
    res = _soak(
        failing_server, out_json, "--num-requests", "20", "--concurrency", "4",
        "--invalid-fraction", "0.1", "--drain-timeout", "0.2",
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout and "FAIL  KV blocks released" in res.stdout, res.stdout
    result = json.loads(out_json.read_text())
    assert result["passed"] is False
    assert result["outcomes"]["failed"] == 20
    # The 18 valid requests got a 5xx; the 2 invalid ones a 500 instead of their 4xx.
    assert result["failures"] == {"http_5xx": 18, "invalid_wrong_status": 2}
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["no failed requests"]["passed"] is False
    assert "http_5xx: 18" in checks["no failed requests"]["detail"]
    assert checks["KV blocks released"]["passed"] is False
    assert checks["KV blocks released"]["detail"].startswith("3 of 100 blocks held")
    assert checks["server idle"]["passed"] is True
    assert checks["memory growth"]["passed"] is False
    assert result["memory_growth"] > 0.10
    assert "request 0 " in res.stdout  # the first failures are shown with their reasons


# --- pagedserve_resident_memory_bytes ------------------------------------------------------------


def _memory_samples(metrics: Metrics) -> dict[str, float]:
    samples = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("pagedserve_resident_memory_bytes{"):
            labels, value = line.split("} ")
            samples[labels.split('process="')[1].rstrip('"')] = float(value)
    return samples


def test_resident_memory_gauge_per_process():
    own = resident_memory_bytes(os.getpid())
    assert own is not None and own > 10 * 2**20
    # The core's sample only when there is a core process (here: this one, as a stand-in).
    both = _memory_samples(Metrics(EngineStats, core_pid=os.getpid))
    assert set(both) == {"server", "core"}
    assert all(v > 10 * 2**20 for v in both.values())
    assert set(_memory_samples(Metrics(EngineStats))) == {"server"}
    # A core that has exited has no sample (nor does anything where /proc is unavailable).
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert resident_memory_bytes(gone.pid) is None
    assert set(_memory_samples(Metrics(EngineStats, core_pid=lambda: gone.pid))) == {"server"}
