"""GET /v1/kv, the live block map, on the real server while known requests stream: a request of
n = 2 whose samples fork its prompt blocks, a second request sharing its prompt's first blocks
through the prefix cache, and what their blocks become once they end."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from pagedserve.scheduler.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED
from pagedserve.scheduler.utils import cdiv
from tests.server.conftest import API_KEY

BLOCK_SIZE = 16  # the servers' default --block-size
# Token-id prompts, so that the shared prefix is exactly 64 tokens (4 blocks) whatever the
# tokenizer makes of text.
PREFIX = list(range(1000, 1064))
PROMPT_A = PREFIX + list(range(2000, 2010))  # 74 tokens: 4 full blocks and 10 tokens
PROMPT_B = PREFIX + list(range(3000, 3005))


def _kv(server) -> dict:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    r = httpx.get(f"{server.v1}/kv", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()


@contextlib.contextmanager
def _stream(server, prompt: list[int], n: int):
    """A streaming completion that runs until closed; yields its id once a token came back."""
    body = {
        "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 1500,
        "ignore_eos": True, "stream": True, "n": n,
    }  # fmt: skip
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                yield json.loads(line[6:])["id"]
                break
        # Leaving the block closes the connection: the server aborts the request.


def _check_consistent(m: dict) -> None:
    """What every map must satisfy: tables fit progress, owners and ref counts agree."""
    states, refs = m["blocks"]["state"], m["blocks"]["ref_count"]
    assert len(states) == len(refs) == m["num_blocks"]
    held: dict[int, list[str]] = {}
    for r in m["requests"]:
        if r["status"] == "running":
            assert len(r["block_ids"]) == cdiv(r["num_computed_tokens"], m["block_size"])
        for block in r["block_ids"]:
            if block is not None:  # (None: a sliding-window block given back)
                held.setdefault(block, []).append(r["id"])
    assert {int(b): sorted(ids) for b, ids in m["owners"].items()} == {
        b: sorted(ids) for b, ids in held.items()
    }
    for block, state in enumerate(states):
        assert (state == BLOCK_USED) == (block in held)
        assert refs[block] == len(held.get(block, ()))
    totals = m["totals"]
    assert totals["used_blocks"] == len(held)
    assert totals["shared_blocks"] == sum(len(ids) > 1 for ids in held.values())
    # Free, free but cached (evictable prefixes) and in use: every block is one of the three.
    assert (
        totals["free_blocks"] + totals["cached_free_blocks"] + totals["used_blocks"]
        == m["num_blocks"]
    )


def test_kv_map_while_requests_stream(server):
    with _stream(server, PROMPT_A, n=2) as a, _stream(server, PROMPT_B, n=1) as b:
        m = _kv(server)
        _check_consistent(m)
        mine = {r["id"]: r for r in m["requests"] if r["id"].split(":", 1)[1] in (a, b)}
        assert sorted(mine) == sorted([f"0:{a}", f"1:{a}", f"0:{b}"])
        assert all(r["status"] == "running" for r in mine.values())
        a0, a1, b0 = mine[f"0:{a}"], mine[f"1:{a}"], mine[f"0:{b}"]
        assert (a0["num_prompt_tokens"], b0["num_prompt_tokens"]) == (74, 69)
        # The samples of a share the blocks of its full prompt blocks (forked, no copy); b
        # shares the 4 blocks of the common prefix (prefix cache).
        assert a0["block_ids"][:4] == a1["block_ids"][:4] == b0["block_ids"][:4]
        shared = a0["block_ids"][:4]
        assert [m["blocks"]["ref_count"][i] for i in shared] == [3, 3, 3, 3]
        assert all(m["blocks"]["cached"][i] for i in shared)
        # Each sample writes its own tokens: from the prompt's partial fifth block on, tables
        # part ways (copy-on-write).
        assert len({a0["block_ids"][4], a1["block_ids"][4], b0["block_ids"][4]}) == 3
        assert m["totals"]["prefix_cache_hits"] >= 64
        gone = set(a0["block_ids"]) | set(a1["block_ids"]) | set(b0["block_ids"])

    # The streams were closed: the server aborted both requests and freed their blocks. Full
    # blocks stay findable by their prefix (free but cached), the others are plainly free.
    deadline = time.monotonic() + 30
    while True:
        m = _kv(server)
        if not any(r["id"].split(":", 1)[1] in (a, b) for r in m["requests"]):
            break
        assert time.monotonic() < deadline, m["requests"]
        time.sleep(0.1)
    _check_consistent(m)
    states = m["blocks"]["state"]
    assert all(states[i] in (BLOCK_FREE, BLOCK_CACHED) for i in gone if i not in map(
        int, m["owners"]
    ))  # fmt: skip
    assert all(states[i] == BLOCK_CACHED for i in shared)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_kv_map_needs_the_api_key(limited_server, key):
    """limited_server runs the engine loop in its own process (--no-core-process): the map
    comes from there too."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = httpx.get(f"{limited_server.v1}/kv", headers=headers, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    m = _kv(limited_server)
    assert limited_server.api_key == API_KEY
    _check_consistent(m)
    assert m["model"] == "smollm2-135m-instruct" and m["kv_cache_dtype"] == "float32"


def test_the_access_log_never_shows_the_dashboards_key():
    import logging

    from pagedserve.server.api_server import RedactApiKey

    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/dashboard?api_key=s3cret&x=1", "1.1", 200), None,
    )  # fmt: skip
    assert RedactApiKey().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "GET /dashboard?api_key=***&x=1 HTTP/1.1" 200'
