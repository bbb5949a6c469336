"""Over HTTP, a request the engine fails (here: a real model whose logits turn NaN for one
token) gets a 500 in the OpenAI shape, or a final error event and [DONE] on a stream, while
other requests stream on to their normal end; no block stays held and the server keeps serving.
(tests/engine/test_fault_isolation.py injects the other faults: detokenizer, out of memory.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import NAN_TOKEN
from tests.server.util import RunningServer, metric, run_server, sse_events

GOOD_PROMPTS = [list(range(3, 13)), list(range(40, 47))]
BAD_PROMPT = [5, 6, NAN_TOKEN, 9]


@pytest.fixture(scope="module")
def nan_server(nan_llama_dir, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("nan-server") / "server.log"
    with run_server(
        log_path, "--model", str(nan_llama_dir), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "256", "--block-size", "4", "--num-kv-blocks", "64",
    ) as s:  # fmt: skip
        yield s


def _body(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}


def _stream_text(events: list[dict]) -> tuple[str, str | None]:
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return text, events[-1]["choices"][0]["finish_reason"]


def test_a_failed_request_leaves_the_others_streaming(nan_server):
    url = f"{nan_server.v1}/completions"
    alone = [
        httpx.post(url, json=_body(p), timeout=60).json()["choices"][0]["text"]
        for p in GOOD_PROMPTS
    ]
    started = threading.Barrier(len(GOOD_PROMPTS) + 1)
    streamed: dict[int, list] = {}

    def stream(index: int) -> None:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url, json=_body(GOOD_PROMPTS[index], stream=True)) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                started.wait(timeout=30)  # the faulty requests go in while this one streams
                rest = [line for line in lines if line]
        streamed[index] = [first, *rest]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(GOOD_PROMPTS))]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    with httpx.Client(timeout=60) as http:  # one keep-alive connection for all three
        failed = http.post(url, json=_body(BAD_PROMPT))
        failed_stream = http.post(url, json=_body(BAD_PROMPT, stream=True))
        after = http.post(url, json=_body(GOOD_PROMPTS[0]))
    for t in threads:
        t.join(timeout=60)

    assert failed.status_code == 500
    assert failed.json() == {
        "error": {
            "message": "the request failed: the model produced non-finite logits (NaN or "
            "infinity) for this request, so it was stopped instead of sampling from them",
            "type": "server_error",
            "param": None,
            "code": "request_failed",
        }
    }
    assert failed_stream.status_code == 200
    assert sse_events(failed_stream) == [failed.json()]  # the error event, then [DONE]
    for index, lines in streamed.items():
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert _stream_text(events) == (alone[index], "length")
    assert after.json()["choices"][0]["text"] == alone[0]
    assert metric(nan_server, "pagedserve_kv_blocks_used") == 0
    assert httpx.get(f"{nan_server.base_url}/health").status_code == 200
    log = nan_server.log()
    assert "the model produced NaN or infinite logits for 1 request(s)" in log
    assert "Traceback" not in log
