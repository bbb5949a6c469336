"""`pagedserve serve --tensor-parallel-size 2` on CPU: the real SmolLM2 split over two processes
(3 KV heads: 2 + 1) answers as the one-rank server does, with a LoRA adapter as PEFT does, each
request alone as among others (bit for bit), and a rank that dies takes the server down at once:
the open stream ends with an error event, /health turns 503, the exit status is 1, and no process
is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pagedserve.engine.tp_endpoint import free_port
from tests.helpers import child_pids
from tests.server.conftest import LORA_PROMPT, LORA_TOKENS, SMOLLM2_ARGS
from tests.server.test_core_process import _server, _Stream, _wait_gone
from tests.server.util import PAGEDSERVE

REGEX = r"[a-f]{2,4}-[0-9]{3}"
PROMPTS = ["Once upon a time", "In 1492, Columbus", "def fibonacci(n):", "Water boils at",
           "The best way to learn a language is", "1, 2, 3, 4, 5, 1, 2, 3,"]  # fmt: skip
COMPLETION = {
    "model": "smollm2-135m-instruct",
    "prompt": "The three primary colors are",
    "max_tokens": 24,
    "temperature": 0,
}


def test_two_ranks_answer_as_one_and_a_dead_rank_stops_the_server(
    tmp_path, server, smollm2_lora_adapter
):
    want = httpx.post(f"{server.v1}/completions", json=COMPLETION, timeout=60).json()
    adapter, with_adapter, _ = smollm2_lora_adapter
    lora = ("--lora-modules", f"sql={adapter}", "--max-lora-rank", "8")
    with _server(tmp_path, "--tensor-parallel-size", "2", *lora) as tp:
        got = httpx.post(f"{tp.base}/v1/completions", json=COMPLETION, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        # The adapter split over the ranks gives PEFT's tokens (tests/server/conftest.py).
        sql = {**COMPLETION, "model": "sql", "prompt": LORA_PROMPT, "max_tokens": LORA_TOKENS}
        answer = httpx.post(f"{tp.base}/v1/completions", json=sql, timeout=60).json()
        assert answer["choices"][0]["text"] == with_adapter
        # A grammar is rank 0's alone (its sampler masks the logits; the other ranks take its
        # ids): the constrained answer is one rank's too.
        regex = {**COMPLETION, "max_tokens": 16, "structured_outputs": {"regex": REGEX}}
        one = httpx.post(f"{server.v1}/completions", json=regex, timeout=60).json()
        two = httpx.post(f"{tp.base}/v1/completions", json=regex, timeout=60).json()
        assert re.fullmatch(REGEX, two["choices"][0]["text"])
        assert two["choices"][0]["text"] == one["choices"][0]["text"]
        # One request, one answer within the two ranks: prompts in one request (one batch) and
        # each alone give the same tokens and logprobs, bit for bit.
        batch = {**COMPLETION, "prompt": PROMPTS, "max_tokens": 12, "logprobs": 3}
        together = httpx.post(f"{tp.base}/v1/completions", json=batch, timeout=60).json()
        alone = [
            httpx.post(f"{tp.base}/v1/completions", json={**batch, "prompt": p}, timeout=60)
            .json()["choices"][0]
            for p in PROMPTS
        ]  # fmt: skip
        by_index = sorted(together["choices"], key=lambda c: c["index"])
        assert [(c["text"], c["logprobs"]) for c in by_index] == [
            (c["text"], c["logprobs"]) for c in alone
        ]
        log = tp.log()
        assert "query/KV heads per rank 6/2, 3/1 (3 KV heads do not divide by 2" in log
        worker = int(re.search(r"tensor parallel: started ranks 1\.\.1 \(pids (\d+)\)", log)[1])
        assert worker in child_pids(tp.core_pid)
        processes = [tp.core_pid, worker]

        stream = _Stream(tp.base)
        stream.start()
        assert stream.started.wait(60)
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        statuses = set()
        while tp.proc.poll() is None:
            statuses.add(tp.health())
            time.sleep(0.02)
        assert time.monotonic() - killed < 10
        assert tp.proc.returncode == 1
        assert 503 in statuses
        events = stream.events()
        assert stream.error is None
        assert 0 < len(events) - 1
        assert events[-1]["error"]["code"] == "engine_dead"
        assert "the engine core process exited with code 1" in events[-1]["error"]["message"]
        assert _wait_gone(processes) == []


@pytest.mark.slow  # two torchrun agents, two model loads and a server (~30 s): make test-slow
def test_torchrun_starts_the_ranks_as_two_nodes_and_rank_0_serves(tmp_path, server):
    """Two nodes on one machine: each torchrun agent starts one rank of `pagedserve serve`;
    rank 0 serves HTTP (its engine core joins torchrun's store), rank 1 runs its steps."""
    master, port = free_port(), free_port()
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    agents = []
    for rank, log_path in enumerate(logs):
        with open(log_path, "w") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr",
                 "127.0.0.1", "--master-port", str(master), "--no-python", PAGEDSERVE, "serve",
                 "--port", str(port), "--no-access-log", *SMOLLM2_ARGS, "--kv-cache-memory",
                 "0.5", "--tensor-parallel-size", "2"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert all(a.poll() is None for a in agents), logs[0].read_text() + logs[1].read_text()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        want = httpx.post(f"{server.v1}/completions", json=COMPLETION, timeout=60).json()
        got = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert "query/KV heads per rank 6/2, 3/1" in logs[0].read_text()
        agents[0].send_signal(signal.SIGTERM)  # as a scheduler stops a job: rank 0's node first
        assert agents[0].wait(30) == 1  # torchrun reports the signal
        assert agents[1].wait(30) == 0  # rank 0 told rank 1 to stop: a clean exit
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
