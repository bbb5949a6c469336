"""`POST /v1/audio/transcriptions` end to end: a real `pagedserve serve` of the tiny random
Whisper of tests/conftest.py (saved with transformers, no tokenizer: a synthetic one) and the
official openai client. What is checked is the request path, the form, audio decoding and the
response formats: every window's tokens equal the reference's greedy decoding of the same
features (engine/models/whisper.py `greedy`), in every format, streamed or not, alone or with
others, through every engine client (the core process by default, in-process, two data-parallel
cores) and through preemption; bad input gets OpenAI-shaped errors on a connection that stays
usable; blocks are all free after."""

from __future__ import annotations

import io
import math
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile

from pagedserve.engine.frontend.audio import SAMPLE_RATE, decode_audio, duration, windows
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.engine.models.tokenizer import load_tokenizer
from pagedserve.engine.models.whisper import greedy
from pagedserve.engine.models.whisper_features import log_mel
from pagedserve.server.audio.transcription_formats import (
    format_transcription,
    full_text,
    window_segments,
)
from tests.server.util import client, metric, run_server, sse_events

# The tiny model's decoder: 64 positions, decoder_start 3, end of text 2; windows of 3 s.
START, EOS, POSITIONS, WINDOW_S = 3, 2, 64, 3.0


def _wav(seconds: float, hz: float) -> bytes:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    samples = 0.4 * np.sin(2 * np.pi * hz * t) * np.sin(2 * np.pi * 0.5 * t)
    buf = io.BytesIO()
    soundfile.write(buf, samples.astype(np.float32), SAMPLE_RATE, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def whisper(tiny_whisper, tmp_path_factory):
    """(the running server, the model and tokenizer as the server loads them)."""
    folder, _, model = tiny_whisper
    tokenizer = load_tokenizer(resolve_model(str(folder)))
    log = tmp_path_factory.mktemp("whisper-server") / "server.log"
    with run_server(log, "--model", str(folder), "--dtype", "float32", "--served-model-name",
                    "tiny-whisper", "--num-kv-blocks", "256") as server:  # fmt: skip
        yield server, model, tokenizer


def _reference(whisper, wav: bytes, prompt: list[int] = (START,)):
    """(per-window text tokens, segments, seconds) of the reference's greedy decoding."""
    _, model, tokenizer = whisper
    samples = decode_audio(wav)
    features = log_mel(windows(samples, WINDOW_S), 80, 300)
    outputs = greedy(model, features, [list(prompt)] * len(features), POSITIONS - len(prompt))
    tokens = [row[:-1] if row[-1] == EOS else row for row in outputs]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
    seconds = duration(samples)
    return tokens, window_segments(texts, tokens, seconds, WINDOW_S), seconds


def test_every_format_holds_the_reference_transcription(whisper):
    server = whisper[0]
    wav = _wav(7.0, 440.0)  # 3 windows: 0-3 s, 3-6 s, 6-7 s
    tokens, segments, seconds = _reference(whisper, wav)
    assert seconds == 7.0 and len(tokens) == 3
    api = client(server)
    verbose = api.audio.transcriptions.create(
        file=("tone.wav", wav), model="tiny-whisper", response_format="verbose_json",
        timestamp_granularities=["segment"],
    )  # fmt: skip
    assert [s.tokens for s in verbose.segments] == tokens
    assert [(s.start, s.end) for s in verbose.segments] == [(0.0, 3.0), (3.0, 6.0), (6.0, 7.0)]
    assert [s.text for s in verbose.segments] == [s.text for s in segments]
    assert (verbose.duration, verbose.language) == (7.0, "english")
    assert verbose.text == full_text(segments) != ""
    plain = api.audio.transcriptions.create(file=("tone.wav", wav), model="tiny-whisper")
    assert plain.text == full_text(segments)
    assert plain.usage.type == "duration" and plain.usage.seconds == 7
    for fmt in ("text", "srt", "vtt"):
        body = api.audio.transcriptions.create(
            file=("tone.wav", wav), model="tiny-whisper", response_format=fmt
        )
        assert body == format_transcription(segments, fmt, duration=seconds)[0]


def test_a_stream_sends_the_same_text_as_deltas(whisper):
    server = whisper[0]
    wav = _wav(7.0, 440.0)
    tokens, segments, _ = _reference(whisper, wav)
    events = list(
        client(server).audio.transcriptions.create(
            file=("tone.wav", wav), model="tiny-whisper", stream=True
        )
    )
    deltas, done = events[:-1], events[-1]
    assert len(deltas) > 3 and all(e.type == "transcript.text.delta" for e in deltas)
    assert "".join(e.delta for e in deltas) == done.text == full_text(segments)
    assert done.type == "transcript.text.done"
    generated = sum(len(row) for row in tokens) + sum(len(r) < POSITIONS - 1 for r in tokens)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (3, generated)
    # The raw body: OpenAI's event shapes, then [DONE].
    r = httpx.post(f"{server.v1}/audio/transcriptions", files={"file": ("a.wav", wav)},
                   data={"stream": "true", "response_format": "text"}, timeout=60)  # fmt: skip
    assert r.headers["content-type"].startswith("text/event-stream")
    parsed = sse_events(r)
    assert parsed[-1]["type"] == "transcript.text.done" and parsed[-1]["text"] == done.text


def test_a_prompt_and_a_language_reach_the_decoder(whisper):
    """The prompt's tokens come before the start of transcript (this model has no
    <|startofprev|>), and a language is accepted without changing the prompt (no language
    tokens): the result is the reference's decoding from that prompt."""
    server, _, tokenizer = whisper
    wav = _wav(2.0, 660.0)
    # The text after a space (transformers' get_prompt_ids): the byte token of " ", then two
    # of the synthetic tokenizer's "<id>" tokens.
    previous = tokenizer.encode(" <280><290>", add_special_tokens=False)
    assert previous == [33, 280, 290]
    tokens, segments, _ = _reference(whisper, wav, prompt=[*previous, START])
    got = client(server).audio.transcriptions.create(
        file=("a.wav", wav), model="tiny-whisper", prompt="<280><290>", language="de",
        response_format="verbose_json",
    )  # fmt: skip
    assert [s.tokens for s in got.segments] == tokens
    assert got.language == "german"
    assert got.text == full_text(segments)


def test_concurrent_transcriptions_each_get_their_own(whisper):
    server = whisper[0]
    wavs = [_wav(1.0 + i % 4 * 2.5, 200.0 + 90 * i) for i in range(8)]
    expected = [full_text(_reference(whisper, wav)[1]) for wav in wavs]
    got = _transcribe_together(server, wavs)
    assert got == expected
    assert len(set(got)) == 8
    assert metric(server, "pagedserve_kv_blocks_used") == 0
    assert metric(server, "pagedserve_num_requests_running") == 0


BAD_REQUESTS = [
    # (form fields, file, status, param, words of the message)
    ({}, ("x.txt", b"not audio at all"), 400, "file", "could not decode the audio file"),
    ({}, ("empty.wav", b""), 400, "file", "the audio file is empty"),
    ({}, None, 400, "file", "multipart/form-data field named `file`"),
    ({"response_format": "xml"}, "wav", 400, "response_format", "must be one of json, text"),
    ({"temperature": "hot"}, "wav", 400, "temperature", "a number in [0, 1]"),
    ({"temperature": "1.5"}, "wav", 400, "temperature", "a number in [0, 1]"),
    ({"language": "klingon"}, "wav", 400, "language", "not one Whisper knows"),
    ({"model": "whisper-1"}, "wav", 404, "model", "`whisper-1` does not exist"),
    ({"stream": "true", "response_format": "srt"}, "wav", 400, "response_format",
     "a stream carries text deltas"),
    ({"stream": "maybe"}, "wav", 400, "stream", "true or false"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "wav", 400,
     "timestamp_granularities", "word timestamps are not supported"),
    ({"timestamp_granularities[]": "segment"}, "wav", 400, "timestamp_granularities",
     "needs response_format verbose_json"),
    ({"include[]": "logprobs"}, "wav", 400, "include", "not supported"),
]  # fmt: skip


def test_bad_requests_get_openai_errors_and_the_connection_stays_usable(whisper):
    server = whisper[0]
    wav = _wav(1.0, 440.0)
    expected = full_text(_reference(whisper, wav)[1])
    with httpx.Client(base_url=server.v1, timeout=60) as http:
        for data, file, status, param, words in BAD_REQUESTS:
            files = {"file": ("a.wav", wav) if file == "wav" else file} if file else None
            r = http.post("/audio/transcriptions", data=data, files=files)
            assert r.status_code == status, (data, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (data, error)
        r = http.post("/audio/transcriptions", json={"file": "a.wav"})  # not a form at all
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
        r = http.post("/chat/completions", json={"model": "tiny-whisper", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
        assert http.get("/models").json()["data"][0]["max_model_len"] == POSITIONS
        good = http.post("/audio/transcriptions", files={"file": ("a.wav", wav)})
        assert good.status_code == 200 and good.json()["text"] == expected
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert metric(server, "pagedserve_kv_blocks_used") == 0


def test_a_stream_left_early_aborts_its_windows_and_frees_their_blocks(whisper):
    server = whisper[0]
    before = metric(server, "pagedserve_e2e_request_latency_seconds_count")
    with httpx.stream("POST", f"{server.v1}/audio/transcriptions", timeout=60,
                      files={"file": ("a.wav", _wav(9.0, 250.0))},
                      data={"stream": "true"}) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first delta: the client goes away with 3 windows running
    deadline = time.monotonic() + 30
    while _over_engines(server, "pagedserve_num_requests_running") or metric(
        server, "pagedserve_kv_blocks_used"
    ):
        assert time.monotonic() < deadline, "the windows still run after the client left"
        time.sleep(0.05)
    # No window finished on its own: they were aborted.
    assert metric(server, "pagedserve_e2e_request_latency_seconds_count") == before


def test_metrics_count_audio_and_tokens(whisper):
    server = whisper[0]
    wav = _wav(4.5, 300.0)
    tokens, _, _ = _reference(whisper, wav)
    before_audio = metric(server, "pagedserve_audio_seconds_total")
    before_tokens = metric(server, "pagedserve_generation_tokens_total")
    client(server).audio.transcriptions.create(file=("a.wav", wav), model="tiny-whisper")
    assert metric(server, "pagedserve_audio_seconds_total") - before_audio == 4.5
    generated = sum(len(row) + (len(row) < POSITIONS - 1) for row in tokens)  # + end of text
    assert metric(server, "pagedserve_generation_tokens_total") - before_tokens == generated
    assert metric(server, "pagedserve_kv_blocks_total") == 256
    assert math.isclose(metric(server, "pagedserve_kv_cache_usage"), 0.0)


def test_two_data_parallel_cores_serve_transcriptions_through_preemption(
    whisper, tiny_whisper, tmp_path
):
    """On two data-parallel cores, with a pool of 24 blocks each (a window holds 10 for its
    encoder and up to 4 of its own): concurrent transcriptions of 3 windows each preempt one
    another, recompute (encoder included), and still get the reference's text. (The module's
    server runs its core in a process of its own, the default; the multilingual one below runs
    it in the server's process.)"""
    wavs = [_wav(7.0, 200.0 + 90 * i) for i in range(4)]
    expected = [full_text(_reference(whisper, wav)[1]) for wav in wavs]
    with run_server(tmp_path / "server.log", "--model", str(tiny_whisper[0]), "--dtype", "float32",
                    "--served-model-name", "tiny-whisper", "--num-kv-blocks", "24",
                    "--data-parallel-size", "2") as server:  # fmt: skip
        assert _transcribe_together(server, wavs) == expected
        assert _over_engines(server, "pagedserve_num_preemptions_total") > 0
        assert _over_engines(server, "pagedserve_kv_blocks_used") == 0
        kv = httpx.get(f"{server.v1}/kv", timeout=10).json()
        assert kv["totals"]["used_blocks"] == 0 and kv["num_blocks"] == 24


def _transcribe_together(server, wavs: list[bytes]) -> list[str]:
    """The text of each wav, all sent at once."""
    api = client(server)

    def transcribe(wav):
        return api.audio.transcriptions.create(file=("a.wav", wav), model="tiny-whisper").text

    with ThreadPoolExecutor(len(wavs)) as pool:
        return list(pool.map(transcribe, wavs))


def _over_engines(server, name: str) -> float:
    """A family's value summed over its samples: one, or one per data-parallel engine."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith((f"{name} ", f"{name}{{"))]  # fmt: skip
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_a_decoder_only_model_says_it_does_not_transcribe(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).audio.transcriptions.create(file=("a.wav", _wav(1.0, 440.0)), model="x")
    assert e.value.body["code"] == "model_not_supported"
    assert "does not transcribe audio: serve a Whisper model" in e.value.body["message"]


@pytest.fixture(scope="module")
def multilingual(multilingual_whisper, tmp_path_factory):
    folder, hf, tokenizer = multilingual_whisper
    log = tmp_path_factory.mktemp("multilingual-whisper-server") / "server.log"
    with run_server(log, "--model", str(folder), "--dtype", "float32", "--served-model-name",
                    "multilingual", "--no-core-process") as server:  # fmt: skip
        yield server, hf, tokenizer


def _generate(hf, wav: bytes, **options) -> list[list[int]]:
    """transformers' `generate` for each window, as far as the decoder's positions allow, each
    row cut before its end of text."""
    features = log_mel(windows(decode_audio(wav), WINDOW_S), 80, 300)
    # <|startofprev|> and the prompt, then <|startoftranscript|><|lang|><|transcribe|>
    # <|notimestamps|>
    prompt = len(options.get("prompt_ids", [])) + 4
    out = hf.generate(features, max_new_tokens=POSITIONS - prompt, **options).tolist()
    eos = hf.config.eos_token_id
    return [row[: row.index(eos)] if eos in row else row for row in out]


def test_a_real_whisper_tokenizer_and_generation_config(multilingual):
    """With a WhisperTokenizer and a multilingual generation config: the decoder prompt is
    <|startofprev|> prompt <|startoftranscript|><|de|><|transcribe|><|notimestamps|>, the
    suppressed tokens are suppressed, and the text is the tokenizer's: the tokens of
    transformers' `generate(language="de", task="transcribe", prompt_ids=...)`, whole and
    streamed."""
    server, hf, tokenizer = multilingual
    wav = _wav(4.0, 520.0)  # 2 windows
    prompt_ids = tokenizer.get_prompt_ids("hi there", return_tensors="pt")
    assert prompt_ids.tolist() == [262, *tokenizer.encode(" hi there", add_special_tokens=False)]
    expected = _generate(hf, wav, language="de", task="transcribe", prompt_ids=prompt_ids)
    api = client(server)
    got = api.audio.transcriptions.create(
        file=("a.wav", wav), model="multilingual", language="German", prompt="hi there",
        response_format="verbose_json",
    )  # fmt: skip
    assert [s.tokens for s in got.segments] == expected
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in expected]
    assert got.text == "".join(texts).strip() and got.language == "german"
    # English by default, without a prompt; the stream's deltas make the same text.
    expected_en = _generate(hf, wav, language="en", task="transcribe")
    text_en = "".join(tokenizer.decode(row, skip_special_tokens=True) for row in expected_en)
    plain = api.audio.transcriptions.create(file=("a.wav", wav), model="multilingual")
    assert plain.text == text_en.strip()
    events = list(
        api.audio.transcriptions.create(file=("a.wav", wav), model="multilingual", stream=True)
    )
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == text_en.strip()
    assert expected != expected_en  # the language token reached the decoder
