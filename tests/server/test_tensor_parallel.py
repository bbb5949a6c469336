"""`pagedserve serve --tensor-parallel-size 2` on CPU: the real SmolLM2 split over two processes
(3 KV heads: 2 + 1) answers as the one-rank server does, and a rank that dies takes the server
down at once: the open stream ends with an error event, /health turns 503, the exit status is 1,
and no process is left behind."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from tests.helpers import child_pids
from tests.server.test_core_process import _server, _Stream, _wait_gone

COMPLETION = {
    "model": "smollm2-135m-instruct",
    "prompt": "The three primary colors are",
    "max_tokens": 24,
    "temperature": 0,
}


def test_two_ranks_answer_as_one_and_a_dead_rank_stops_the_server(tmp_path, server):
    want = httpx.post(f"{server.v1}/completions", json=COMPLETION, timeout=60).json()
    with _server(tmp_path, "--tensor-parallel-size", "2") as tp:
        got = httpx.post(f"{tp.base}/v1/completions", json=COMPLETION, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
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
