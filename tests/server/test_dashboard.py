"""GET /dashboard: its key check, and the page itself in a real headless chromium (selenium)
against a real `pagedserve serve` with a 512-block pool while requests stream.

PAGEDSERVE_UPDATE_SCREENSHOT=1 also writes the page's screenshot to docs/dashboard.png.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.wait import WebDriverWait

from tests.server.util import RunningServer, run_server

API_KEY = "dashboard-key-0123456789"
NUM_BLOCKS = 512
SERVER_ARGS = (
    "--dtype", "float32", "--max-model-len", "2048", "--num-kv-blocks", str(NUM_BLOCKS),
    "--api-key", API_KEY,
)  # fmt: skip
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2-135m-instruct"
UPDATE_SCREENSHOT = os.environ.get("PAGEDSERVE_UPDATE_SCREENSHOT") == "1"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
# What `make browser` runs (the Makefile holds the set-up; the test only names it).
BROWSER_PACKAGES_INSTALL = "apt-get install -y chromium chromium-driver"
# This machine's network is closed: without the background-networking flags chromium keeps
# trying to reach Google's update and sync services.
CHROMIUM_ARGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--window-size=1440,1000",
)  # fmt: skip
# Two prompts sharing ~300 tokens (the second finds them in the prefix cache) and a third run
# with n=2 (its samples fork the prompt's blocks): all three make shared blocks.
PREFIX = 2 * (
    "The history of the Roman Empire spans many centuries, from the founding of the city on the "
    "banks of the Tiber to the fall of Constantinople in 1453. Historians have long debated the "
    "causes of its decline in the west, citing economic troubles, the debasement of the coinage, "
    "military overreach, political instability, plagues, the division of the empire between two "
    "courts, and the pressures of migrating peoples along its long frontiers on the Rhine and the "
    "Danube. Others stress continuity rather than collapse, and speak of a transformation. "
)
STORY = (
    "A lighthouse keeper lived alone on a rock far out at sea. Every evening he climbed the "
    "spiral stair, trimmed the wick, polished the great lens and watched the beam sweep across "
    "the dark water, counting the ships that passed and writing their names in a worn logbook. "
    "One winter a storm came that was worse than any he remembered, and the radio fell silent. "
)
# A request that has ended before the page opens: its full blocks stay in the prefix cache,
# free but cached (evictable).
FINISHED = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light; "
    "the energy splits water, releasing oxygen, and drives the synthesis of ATP and NADPH, which "
    "the Calvin cycle then uses to fix carbon dioxide into sugars. Explain each step in detail."
)


@dataclass
class Stream:
    """One streaming completion read in a background thread until it ends or `stop` is set."""

    body: dict[str, Any]
    request_id: str | None = None  # the chunks' "id": the request id the samples share
    first_chunk: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _read_stream(server: RunningServer, stream: Stream, stop: threading.Event) -> None:
    try:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{server.v1}/completions", json=stream.body, headers=AUTH) as r,
        ):
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and stream.request_id is None:
                    stream.request_id = json.loads(line.removeprefix("data: "))["id"]
                    stream.first_chunk.set()
                if stop.is_set():
                    break  # leaving the block closes the stream: the server aborts the request
    except BaseException as e:  # reported by the test, not lost in the thread
        stream.error = e
        stream.first_chunk.set()


@contextlib.contextmanager
def streaming(server: RunningServer, *waves: list[dict[str, Any]]) -> Iterator[list[Stream]]:
    """Start one streaming completion per body, wave after wave: a wave starts once every
    stream before it has sent its first token (its prompt's blocks are computed then, and in
    the prefix cache). Stop and join them all on exit."""
    stop = threading.Event()
    streams: list[Stream] = []
    threads: list[threading.Thread] = []
    try:
        for wave in waves:
            for body in wave:
                stream = Stream(body)
                thread = threading.Thread(
                    target=_read_stream, args=(server, stream, stop), daemon=True
                )
                streams.append(stream)
                threads.append(thread)
                thread.start()
            for stream in streams:
                assert stream.first_chunk.wait(60), f"no token in 60 s:\n{server.log()[-3000:]}"
                assert stream.error is None, stream.error
        yield streams
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a stream did not stop"


def _completion(prompt: str, **kwargs: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True, **kwargs}  # fmt: skip


def _kv(server: RunningServer) -> dict[str, Any]:
    r = httpx.get(f"{server.v1}/kv", headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json()


def _request_id(sample_id: str) -> str:
    """A sample id is "<index>:<request id>" (engine/frontend/output_processor.py `_child_id`)."""
    return sample_id.partition(":")[2]


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("dashboard-server") / "server.log"
    with run_server(log_path, *SERVER_ARGS) as s:
        yield RunningServer(s.base_url, s.log_path, API_KEY)


@pytest.fixture(scope="session")
def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver), which `make browser` installs (`make test` runs it first). A
    machine without them fails rather than skips: the page would go untested."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.fail(
            "the dashboard test needs Debian's chromium and chromium-driver: run `make browser` "
            f"(as root, or: sudo {BROWSER_PACKAGES_INSTALL})",
            pytrace=False,
        )
    return chromium, chromedriver


@pytest.fixture(scope="module")
def browser(chromium_paths, tmp_path_factory) -> Iterator[webdriver.Chrome]:
    chromium, chromedriver = chromium_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (*CHROMIUM_ARGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    # An explicit driver: selenium-manager must not try to download one.
    driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_needs_the_key_and_is_self_contained(dash_server):
    url = f"{dash_server.base_url}/dashboard"
    for params, headers in (({}, {}), ({"api_key": "wrong"}, {}), ({}, {"Authorization": "wrong"})):
        r = httpx.get(url, params=params, headers=headers)
        assert r.status_code == 401, r.text
        assert set(r.json()) == {"error"}
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key"
        assert "/dashboard?api_key=" in error["message"]  # how a browser gives the key
    for params, headers in (({}, AUTH), ({"api_key": API_KEY}, {})):
        r = httpx.get(url, params=params, headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
    html = r.text
    # Works offline: nothing loaded from elsewhere (scripts, styles, images, fonts, imports).
    external = re.findall(
        r"""(?:\b(?:src|href)\s*=\s*["']?|url\(\s*["']?|@import\s+["']?)\s*(?:https?:)?//""",
        html,
        flags=re.IGNORECASE,
    )
    assert external == []
    assert "<script src" not in html and "<link" not in html


# Everything the page drew from one poll, read in one synchronous script (so no poll runs
# between the reads): the map it drew, every cell and every table row.
READ_PAGE = """
const cells = [...document.querySelectorAll("#pool .block")].map((c) => [
  c.className, Number(c.dataset.blockId), c.dataset.owner, c.title]);
const rows = [...document.querySelectorAll("#requests tr[data-request-id]")].map((tr) =>
  [...tr.children].map((td) => td.textContent));
return {map: window.kvDashboard.map(), cells, rows, polls: Number(document.body.dataset.polls),
        drawn: document.body.dataset.blocksDrawn, perCell: document.body.dataset.blocksPerCell,
        scale: document.getElementById("scale").textContent,
        banner: document.getElementById("banner").className};
"""

STATE_CLASS = ("free", "cached", "used")
STATUS_ORDER = ("running", "waiting", "preempted", "swapped")


def _expected_class(kv: dict[str, Any], block: int) -> str:
    state, ref = kv["blocks"]["state"][block], kv["blocks"]["ref_count"][block]
    classes = ["block", STATE_CLASS[state]]
    if ref > 1:
        classes.append("shared")
    if state == 2 and kv["blocks"]["cached"][block]:
        classes.append("hashed")
    return " ".join(classes)


def _wait(driver: webdriver.Chrome, script: str, what: str, timeout: float = 30) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda d: d.execute_script(script), what
    )


def test_dashboard_draws_the_live_pool(dash_server, browser, tmp_path):
    s = dash_server
    finished = httpx.post(
        f"{s.v1}/completions",
        json={"model": MODEL, "prompt": FINISHED, "max_tokens": 1},
        headers=AUTH,
        timeout=60,
    )
    assert finished.status_code == 200, finished.text
    with streaming(
        s,
        [
            _completion(PREFIX + "Question: who was Augustus? Answer:"),
            _completion(STORY + "Tell the rest of the story.", n=2),
        ],
        [_completion(PREFIX + "Question: who was Nero? Answer:")],  # finds PREFIX cached
    ) as streams:
        request_ids = {stream.request_id for stream in streams}
        browser.get(f"{s.base_url}/dashboard?api_key={API_KEY}")
        _wait(
            browser,
            "return Number(document.body.dataset.polls) >= 3 && "
            "document.querySelector('#pool .block.used') !== null",
            "the page drew no block in use after 30 s",
        )
        page = browser.execute_script(READ_PAGE)
        kv = page["map"]
        running = [r for r in kv["requests"] if r["status"] == "running"]
        # All four samples still stream (400 tokens each): the page drew them running.
        assert {_request_id(r["id"]) for r in running} == request_ids, kv["requests"]
        assert not any(stream.error for stream in streams)

        # The grid: exactly one cell per block, each drawn as the map says.
        assert page["drawn"] == str(NUM_BLOCKS) and page["perCell"] == "1"
        assert page["scale"] == "1 cell = 1 block"
        assert len(page["cells"]) == NUM_BLOCKS
        for block, (cls, block_id, owner, title) in enumerate(page["cells"]):
            assert block_id == block
            assert cls == _expected_class(kv, block), (block, title)
            owners = kv["owners"].get(str(block), [])
            assert owner == (_request_id(owners[0]) if owners else "")
            assert title.startswith(f"block {block} · ")
            assert f"ref {kv['blocks']['ref_count'][block]}" in title
            assert all(o in title for o in owners)
        owners_drawn = {owner for cls, _, owner, _ in page["cells"] if " used" in cls}
        assert owners_drawn == request_ids
        # The shared prompt prefix and the n=2 fork: blocks in several tables, marked shared.
        assert kv["totals"]["shared_blocks"] > 0
        assert sum(" shared" in c[0] for c in page["cells"]) == kv["totals"]["shared_blocks"]
        assert sum(" used" in c[0] for c in page["cells"]) == kv["totals"]["used_blocks"]
        # The finished request's blocks: free, still in the prefix cache.
        assert kv["totals"]["cached_free_blocks"] > 0
        cached_cells = sum(c[0] == "block cached" for c in page["cells"])
        assert cached_cells == kv["totals"]["cached_free_blocks"]

        # The table: every live request, running ones first, with its numbers.
        expected_rows = sorted(kv["requests"], key=lambda r: STATUS_ORDER.index(r["status"]))
        assert [row[0] for row in page["rows"]] == [r["id"] for r in expected_rows]
        for row, r in zip(page["rows"], expected_rows, strict=True):
            numbers = [r["num_prompt_tokens"], r["num_output_tokens"], r["num_computed_tokens"],
                       len(r["block_ids"]), r["num_swapped_blocks"], r["num_unused_slots"],
                       r["num_preemptions"]]  # fmt: skip
            assert row[1:] == [r["status"], *(f"{n:,}" for n in numbers)]
        # The test's own read of /v1/kv agrees on who is running.
        assert {_request_id(r["id"]) for r in _kv(s)["requests"]} == request_ids

        if UPDATE_SCREENSHOT:  # a few more polls, for the chart
            _wait(browser, "return Number(document.body.dataset.polls) >= 12", "polls stopped")
        _screenshot(browser, tmp_path)

        # Errors show a banner, and the page keeps polling through them.
        browser.execute_script("""
            window.realFetch = window.fetch;
            window.fetch = () => Promise.resolve(new Response(
                '{"error": {"message": "bad key"}}', {status: 401}));""")
        _wait(browser, "return document.getElementById('banner').textContent.includes('401')",
              "no banner for a 401")  # fmt: skip
        browser.execute_script("window.fetch = () => Promise.reject(new TypeError('offline'))")
        _wait(browser, "return document.getElementById('banner').textContent.includes('reach')",
              "no banner for a network error")  # fmt: skip
        polls = browser.execute_script("return Number(document.body.dataset.polls)")
        browser.execute_script("window.fetch = window.realFetch")
        _wait(browser, f"return Number(document.body.dataset.polls) > {polls} && "
                       "!document.getElementById('banner').classList.contains('show')",
              "the page did not recover after the errors")  # fmt: skip

        # Only same-origin resources were loaded: nothing from the network.
        urls = browser.execute_script(
            "return performance.getEntriesByType('resource').map((e) => e.name)"
        )
        assert urls and all(u.startswith(s.base_url + "/") for u in urls), urls


def test_dashboard_draws_k_blocks_per_cell_for_big_pools(dash_server, browser):
    """Above 16,384 blocks one cell stands for k blocks and takes their most used state. The
    map is made here and drawn by the page's own render function (a 40,000-block pool would
    need 29 GB of KV cache at this model's float32 block size)."""
    browser.get(f"{dash_server.base_url}/dashboard?api_key={API_KEY}")
    _wait(browser, "return Number(document.body.dataset.polls) >= 1", "no poll in 30 s")
    kv = _kv(dash_server)
    n = 40_000
    k = math.ceil(n / 16384)  # 3: 13,334 cells, the last holding block 39,999 alone
    state, refs, cached = [0] * n, [0] * n, [False] * n
    owners: dict[str, list[str]] = {}

    def use(block: int, ref: int, *samples: str) -> None:
        state[block], refs[block], cached[block] = 2, ref, True
        owners[str(block)] = list(samples)

    use(5, 1, "0:req-a")  # cell 1: free, free, used
    state[9] = 1  # cell 3: cached free, free, free
    cached[9] = True
    use(13, 2, "1:req-b", "0:req-c")  # cell 4: free, used (shared), free
    use(n - 1, 1, "0:req-a")  # the last cell
    kv.update(num_blocks=n, blocks={"state": state, "ref_count": refs, "cached": cached},
              owners=owners, requests=[])  # fmt: skip
    page = browser.execute_script("window.kvDashboard.render(arguments[0]);" + READ_PAGE, kv)
    assert page["drawn"] == str(math.ceil(n / k)) == "13334" and page["perCell"] == str(k)
    assert page["scale"].startswith("1 cell = 3 blocks")
    cells = page["cells"]
    assert [c[1] for c in cells[:5]] == [0, 3, 6, 9, 12]
    assert [(c[0], c[2]) for c in cells[:5]] == [
        ("block free", ""),
        ("block used hashed", "req-a"),
        ("block free", ""),
        ("block cached", ""),
        ("block used shared hashed", "req-b"),
    ]
    assert cells[-1][:3] == ["block used hashed", n - 1, "req-a"]
    assert cells[4][3].startswith("blocks 12–14 · 1 in use, 0 cached, 2 free · max ref 2")
    assert sum(" used" in c[0] for c in cells) == 3
    # The next poll draws the real pool again, one cell per block.
    _wait(browser, f"return document.body.dataset.blocksDrawn === '{NUM_BLOCKS}'",
          "the page did not go back to the real pool")  # fmt: skip


def _screenshot(driver: webdriver.Chrome, tmp_path: Path) -> None:
    """The whole page as it is now, under tmp_path (and in docs/ when asked)."""
    height = driver.execute_script(
        "return Math.ceil(document.body.getBoundingClientRect().height)"
        " + window.outerHeight - window.innerHeight"
    )
    driver.set_window_size(1440, max(600, height))
    time.sleep(0.3)  # the chart redraws for the new size
    path = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(path))
    print(f"dashboard screenshot: {path}")
    if UPDATE_SCREENSHOT:
        SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, SCREENSHOT)
        print(f"dashboard screenshot: {SCREENSHOT}")
