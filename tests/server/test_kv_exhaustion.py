"""KV exhaustion over HTTP: far more concurrent demand than the server has KV blocks. Every
request still completes, through preemption and recompute, with the greedy text it gets when it
runs alone, and every block is back in the pool at the end."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.scheduler.utils import cdiv
from tests.server.util import RunningServer, metric, run_server, sse_events

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 24
MAX_TOKENS = 32
rng = random.Random(11)
# Token ids of the tiny Llama (its synthetic tokenizer decodes every id to distinct text).
PROMPTS = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 41))] for _ in range(8)]


@pytest.fixture(scope="module")
def tight_server(tiny_llama_dir, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("tight-kv") / "server.log"
    with run_server(
        log_path, "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--max-model-len", "96",
    ) as s:  # fmt: skip
        yield s


def _complete(server: RunningServer, prompt: list[int], stream: bool) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.v1}/completions", json={**body, "stream": stream}, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        choices = [e["choices"][0] for e in sse_events(r)]
        return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
    (choice,) = r.json()["choices"]
    return choice["text"], choice["finish_reason"]


def test_four_times_the_demand_completes_with_unloaded_outputs(tight_server):
    demand = sum(cdiv(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS)
    assert demand >= 4 * NUM_KV_BLOCKS
    alone = [_complete(tight_server, p, stream=False) for p in PROMPTS]
    assert metric(tight_server, "pagedserve_num_preemptions_total") == 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once; every other one streams
        loaded = list(pool.map(_complete, [tight_server] * 8, PROMPTS, [False, True] * 4))
    assert loaded == alone
    assert {reason for _, reason in loaded} == {"length"}
    assert metric(tight_server, "pagedserve_num_preemptions_total") > 0
    assert metric(tight_server, "pagedserve_kv_blocks_used") == 0
