"""`pagedserve bench serve`: its pure parts (statistics, SSE parsing, arrivals, prompt files, the
model card's max_model_len, the plot), then a whole run against a real server of the dummy
model."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from pathlib import Path

import httpx
import pytest

from pagedserve.bench import serve as bench_serve
from pagedserve.bench.serve import (
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    arrival_times,
    build_request,
    poisson_gaps,
    random_token_ids,
    read_prompts_file,
)
from pagedserve.bench.serve_report import (
    format_report,
    output_tokens_over_time,
    per_request_lists,
    plot_results,
    summarize,
)
from pagedserve.bench.serve_stream import RequestRecord, SSEDecoder, StreamRecorder


def _ok(start, ttft, itls, e2el, prompt_tokens, completion_tokens) -> RequestRecord:
    return RequestRecord(
        success=True,
        start=start,
        ttft=ttft,
        itls=list(itls),
        e2el=e2el,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


# Three successful requests and one failure. Times are multiples of 1/8 s (exact in binary).
RECORDS = [
    _ok(0.0, 0.125, [0.25, 0.25, 0.5], 1.25, 10, 4),  # TPOT (1.25 - 0.125) / 3 = 0.375
    _ok(0.5, 0.25, [0.5], 1.0, 20, 2),  # TPOT (1.0 - 0.25) / 1 = 0.75
    _ok(1.0, 0.5, [], 0.5, 30, 1),  # one token: no TPOT, no ITL
    RequestRecord(success=False, start=1.5, e2el=0.125, error="HTTP 500: boom"),
]


# --- summary ---------------------------------------------------------------------------------


def test_summary_counts_and_throughputs():
    s = summarize(RECORDS, duration=2.0)
    assert s["completed"] == 3
    assert s["failed"] == 1
    assert s["duration"] == 2.0
    # Failed requests add no tokens.
    assert s["total_input_tokens"] == 60
    assert s["total_output_tokens"] == 7
    assert s["request_throughput"] == 1.5
    assert s["output_throughput"] == 3.5
    assert s["total_token_throughput"] == 33.5


def test_summary_latency_stats_by_hand():
    s = summarize(RECORDS, duration=2.0)
    # TTFT of the successful requests only: 125, 250, 500 ms (the failure's 0 is not there).
    # numpy linear percentiles: index q/100 * (n - 1) into the sorted list.
    assert s["mean_ttft_ms"] == pytest.approx(875 / 3, rel=1e-12)
    assert s["median_ttft_ms"] == 250.0
    assert s["p90_ttft_ms"] == pytest.approx(250 + 0.8 * 250, rel=1e-12)  # index 1.8
    assert s["p99_ttft_ms"] == pytest.approx(250 + 0.98 * 250, rel=1e-12)  # index 1.98
    # TPOT: 375 and 750 ms; the single-token request is excluded.
    assert s["mean_tpot_ms"] == pytest.approx(562.5, rel=1e-12)
    assert s["median_tpot_ms"] == pytest.approx(562.5, rel=1e-12)
    assert s["p90_tpot_ms"] == pytest.approx(375 + 0.9 * 375, rel=1e-12)
    assert s["p99_tpot_ms"] == pytest.approx(375 + 0.99 * 375, rel=1e-12)
    # ITL pools every gap: 250, 250, 500, 500 ms.
    assert s["mean_itl_ms"] == 375.0
    assert s["median_itl_ms"] == 375.0
    assert s["p90_itl_ms"] == pytest.approx(500.0, rel=1e-12)  # index 2.7, between two 500s
    assert s["p99_itl_ms"] == pytest.approx(500.0, rel=1e-12)
    # E2E: 500, 1000, 1250 ms.
    assert s["mean_e2el_ms"] == pytest.approx(2750 / 3, rel=1e-12)
    assert s["median_e2el_ms"] == 1000.0
    assert s["p90_e2el_ms"] == pytest.approx(1000 + 0.8 * 250, rel=1e-12)
    assert s["p99_e2el_ms"] == pytest.approx(1000 + 0.98 * 250, rel=1e-12)


def test_summary_with_no_successes_has_none_stats():
    s = summarize([RequestRecord(success=False, error="x")], duration=1.0)
    assert (s["completed"], s["failed"], s["output_throughput"]) == (0, 1, 0.0)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"mean_{key}_ms"] is None
        assert s[f"p99_{key}_ms"] is None
    report = format_report(s, {"max_concurrency": None, "request_rate": math.inf})
    assert "Mean TTFT (ms):                          n/a" in report


def test_summary_rejects_a_zero_duration():
    with pytest.raises(ValueError, match="duration"):
        summarize(RECORDS, duration=0.0)


def test_report_layout():
    s = summarize(RECORDS, duration=2.0)
    lines = format_report(s, {"max_concurrency": 8, "request_rate": 4.0}).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     3"
    assert lines[2] == "Failed requests:                         1"
    assert "Output token throughput (tok/s):         3.50" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Median TTFT (ms):                        250.00" in lines
    assert "P99 ITL (ms):                            500.00" in lines
    assert lines[-1] == "=" * 50


def test_per_request_lists_keep_submission_order():
    lists = per_request_lists(RECORDS)
    assert lists["ttfts"] == [0.125, 0.25, 0.5, None]
    assert lists["e2els"] == [1.25, 1.0, 0.5, None]
    assert lists["itls"] == [[0.25, 0.25, 0.5], [0.5], [], []]
    assert lists["completion_tokens"] == [4, 2, 1, 0]
    assert lists["errors"] == ["", "", "", "HTTP 500: boom"]
    json.dumps(lists)  # JSON-serialisable as is


# --- SSE parsing -----------------------------------------------------------------------------


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _completion_chunk(text: str) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def _chat_chunk(delta: dict) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_sse_event_split_across_chunks():
    d = SSEDecoder()
    raw = _event(_completion_chunk("héllo"))  # é is two bytes in UTF-8
    cut = raw.index("é".encode()) + 1  # cut between the two bytes of é
    assert d.feed(raw[:5]) == []
    assert d.feed(raw[5:cut]) == []
    assert d.feed(raw[cut:-1]) == []  # the blank line is not complete yet
    assert [json.loads(e) for e in d.feed(raw[-1:])] == [_completion_chunk("héllo")]


def test_sse_many_events_in_one_chunk_and_done():
    d = SSEDecoder()
    data = _event(_completion_chunk("a")) + _event(_completion_chunk("b")) + b"data: [DONE]\n\n"
    events = d.feed(data)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[2] == "[DONE]"


def test_sse_crlf_comments_and_multiline_data():
    d = SSEDecoder()
    assert d.feed(b": keep-alive\r\n\r\ndata: x\r") == []
    # The "\r" ending the last chunk pairs with this "\n".
    assert d.feed(b"\ndata:y\r\n\r\n") == ["x\ny"]


def test_recorder_times_completion_stream():
    r = StreamRecorder("completions", start=1.0)
    r.feed(_event(_completion_chunk("")), now=1.1)  # empty text (held-back bytes): not a token
    r.feed(_event(_completion_chunk("a")) + _event(_completion_chunk("b")), now=1.25)
    r.feed(_event(_completion_chunk("c")), now=1.75)
    r.feed(_event(USAGE) + b"data: [DONE]\n\n", now=1.75)
    rec = r.finish(now=2.0)
    assert rec.success and rec.error == ""
    assert rec.ttft == 0.25
    assert rec.itls == [0.0, 0.5]
    assert rec.e2el == 1.0
    assert (rec.prompt_tokens, rec.completion_tokens) == (5, 3)
    assert rec.text_chunk_times() == [1.25, 1.25, 1.75]


def test_recorder_chat_role_only_first_chunk_is_not_a_token():
    r = StreamRecorder("chat", start=0.0)
    r.feed(_event(_chat_chunk({"role": "assistant"})), now=0.125)
    r.feed(_event(_chat_chunk({"role": "assistant", "content": ""})), now=0.25)
    r.feed(_event(_chat_chunk({"content": "Hi"})), now=0.5)
    r.feed(_event(_chat_chunk({"content": " there"})), now=0.75)
    r.feed(_event(_chat_chunk({})), now=0.75)  # finish_reason chunk, no content
    r.feed(_event(USAGE), now=0.875)
    r.feed(b"data: [DONE]\n\n", now=0.875)
    rec = r.finish(now=1.0)
    assert rec.success
    assert rec.ttft == 0.5
    assert rec.itls == [0.25]


def test_recorder_failures():
    no_usage = StreamRecorder("completions", start=0.0)
    no_usage.feed(_event(_completion_chunk("a")) + b"data: [DONE]\n\n", now=0.5)
    rec = no_usage.finish(now=0.5)
    assert not rec.success and "usage" in rec.error

    error_event = StreamRecorder("completions", start=0.0)
    error_event.feed(_event({"error": {"message": "KV cache exhausted", "code": 500}}), now=0.5)
    error_event.feed(_event(USAGE), now=0.5)
    rec = error_event.finish(now=0.5)
    assert not rec.success and rec.error == "error event: KV cache exhausted"

    transport = StreamRecorder("completions", start=0.25)
    transport.feed(_event(_completion_chunk("a")), now=0.5)
    rec = transport.finish(now=1.0, error="ReadError: connection reset")
    assert not rec.success and rec.error == "ReadError: connection reset"
    assert rec.e2el == 0.75


# --- arrivals --------------------------------------------------------------------------------


def test_poisson_gaps_are_seeded():
    assert poisson_gaps(100, 4.0, seed=7) == poisson_gaps(100, 4.0, seed=7)
    assert poisson_gaps(100, 4.0, seed=7) != poisson_gaps(100, 4.0, seed=8)


def test_poisson_gaps_have_mean_one_over_rate():
    gaps = poisson_gaps(10_000, 4.0, seed=0)
    assert min(gaps) >= 0
    # The mean of 10k exponential gaps has standard error (1/rate)/sqrt(10k) = 1% of the mean;
    # 5% is five standard errors.
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # An exponential's standard deviation equals its mean.
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert poisson_gaps(5, math.inf, seed=0) == [0.0] * 5
    assert arrival_times(poisson_gaps(5, math.inf, seed=0)) == [0.0] * 5


def test_arrival_times_start_at_zero():
    assert arrival_times([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]


# --- workload --------------------------------------------------------------------------------


def test_random_token_ids_are_seeded_and_in_range():
    ids = random_token_ids(4, 16, seed=3)
    assert ids == random_token_ids(4, 16, seed=3)
    assert ids != random_token_ids(4, 16, seed=4)
    assert [len(p) for p in ids] == [16] * 4
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for p in ids for t in p)


def test_read_prompts_txt_cycles_and_skips_blank_lines(tmp_path: Path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\n  second, indented \nthird\n")
    assert read_prompts_file(path, 7) == [
        "first prompt",
        "  second, indented ",
        "third",
        "first prompt",
        "  second, indented ",
        "third",
        "first prompt",
    ]
    assert read_prompts_file(path, 2) == ["first prompt", "  second, indented "]


def test_read_prompts_jsonl(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a\\nb", "id": 1}\n\n{"prompt": "c"}\n')
    assert read_prompts_file(path, 3) == ["a\nb", "c", "a\nb"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_prompts_file(bad, 2)


def test_read_prompts_empty_or_missing_file(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts_file(empty, 4)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts_file(tmp_path / "missing.txt", 4)


def test_build_request_bodies():
    path, body = build_request("completions", "m", [1001, 1002], 8, ignore_eos=True)
    assert path == "/v1/completions"
    assert body == {
        "model": "m",
        "prompt": [1001, 1002],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    path, body = build_request("chat", "m", "hi", 8, ignore_eos=False)
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in body and "prompt" not in body


def test_bench_serve_reads_max_model_len_from_the_model_card():
    """Token-id prompts need no tokenizer: the length check reads GET /v1/models, not
    /tokenize (which a model without a tokenizer answers with 400)."""
    from pagedserve.bench.serve import _max_model_len

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        cards = [{"id": "a", "max_model_len": 128}, {"id": "b", "max_model_len": 4096}]
        return httpx.Response(200, json={"object": "list", "data": cards + [{"id": "c"}]})

    async def ask(model: str) -> int | None:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await _max_model_len(client, model)

    assert asyncio.run(ask("b")) == 4096
    assert asyncio.run(ask("c")) is None  # a card without the field: no check
    assert asyncio.run(ask("missing")) is None


# --- plot ------------------------------------------------------------------------------------


def test_output_tokens_over_time_spreads_usage_over_chunks():
    # Duration 2 s -> 0.1 s bins. Request 0's 4 tokens over chunks at 0.125, 0.375, 0.625, 1.125;
    # request 1's 2 tokens over chunks at 0.75 and 1.25; request 2's 1 token at 1.5.
    starts, rates, bin_s = output_tokens_over_time(RECORDS, duration=2.0)
    assert bin_s == 0.1
    tokens = rates * bin_s
    assert tokens.sum() == pytest.approx(7.0)
    assert tokens[1] == pytest.approx(1.0)  # [0.1, 0.2): one chunk of request 0
    assert tokens[7] == pytest.approx(1.0)  # [0.7, 0.8): one of request 1's two chunks


def test_plot_writes_a_png(tmp_path: Path):
    path = tmp_path / "bench.png"
    plot_results(RECORDS, summarize(RECORDS, duration=2.0), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_successes_still_writes_a_png(tmp_path: Path):
    records = [RequestRecord(success=False, error="x")]
    path = tmp_path / "empty.png"
    plot_results(records, summarize(records, duration=1.0), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("endpoint", "prompt_tokens"),
    # The dummy server's synthetic tokenizer: chat prompts are the 16 detokenized ids inside the
    # template's 22 bytes, 38 tokens.
    [("completions", 16), ("chat", 38)],
)
def test_bench_serve_runs_on_random_ids(dummy_server, endpoint, prompt_tokens, capsys):
    args = bench_serve.parse_args(
        ["--base-url", dummy_server.base_url, "--endpoint", endpoint, "--num-prompts", "4",
         "--input-len", "16", "--output-len", "4"]
    )  # fmt: skip
    result = bench_serve.run(args)
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_input_tokens"] == 4 * prompt_tokens
    assert result["total_output_tokens"] == 4 * 4
