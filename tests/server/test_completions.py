"""POST /v1/completions against a real server process with the real SmolLM2, through the official
openai client (and httpx where the raw SSE bytes matter)."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.scheduler import SamplingParams
from tests.server.util import client, sse_events, stream_choices, token_count

PROMPT = "The capital of France is"


def _stream_text(chunks, num_choices: int = 1) -> tuple[list[str], list[str | None], dict | None]:
    pieces, finish, usage = stream_choices(chunks, "text_completion", num_choices)
    return ["".join(c.text for c in choice) for choice in pieces], finish, usage


def test_greedy_completion_equals_the_offline_engine(server, real_llm):
    c = client(server)
    r = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=12, temperature=0
    )
    offline = real_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == "smollm2-135m-instruct"
    assert len(r.choices) == 1
    assert r.choices[0].text == offline.text
    assert r.choices[0].text.startswith(" Paris")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == token_count(server, prompt=PROMPT) == 5
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == 17


def test_streamed_greedy_text_equals_non_streamed(server):
    c = client(server)
    kwargs = dict(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=20, temperature=0)
    whole = c.completions.create(**kwargs)
    chunks = list(
        c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    texts, finish, usage = _stream_text(chunks)
    assert texts == [whole.choices[0].text]
    assert finish == [whole.choices[0].finish_reason]
    assert usage == whole.usage.model_dump()
    assert len({chunk.id for chunk in chunks}) == 1
    # Without include_usage there is no usage chunk.
    chunks = list(c.completions.create(**kwargs, stream=True))
    assert all(chunk.usage is None and len(chunk.choices) == 1 for chunk in chunks)


def test_sse_framing_is_data_lines_and_done(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    r = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events) != ""


def test_token_id_prompt_gives_the_same_text_as_the_string(server):
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    c = client(server)
    a = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=8, temperature=0
    )
    b = c.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens == len(ids)


def test_several_prompts_in_one_request(server):
    c = client(server)
    prompts = [PROMPT, "One, two, three,"]
    alone = [
        c.completions.create(model="smollm2-135m-instruct", prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    body = dict(model="smollm2-135m-instruct", prompt=prompts, max_tokens=6, temperature=0)
    both = c.completions.create(**body)
    assert [ch.index for ch in both.choices] == [0, 1]
    assert [ch.text for ch in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 12
    streamed = c.completions.create(**body, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = _stream_text(streamed, num_choices=2)
    assert texts == [ch.text for ch in both.choices]
    assert finish == ["length", "length"]
    assert usage == both.usage.model_dump()


def test_n2_seeded_samples_reproduce_and_stream_the_same(server):
    c = client(server)
    kwargs = dict(
        model="smollm2-135m-instruct",
        prompt="Once upon a time",
        max_tokens=16,
        temperature=1.0,
        n=2,
        seed=1234,
    )
    a = c.completions.create(**kwargs)
    b = c.completions.create(**kwargs)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text != a.choices[1].text  # sample k uses seed + k
    assert a.usage.completion_tokens == 32
    texts, _, usage = _stream_text(
        c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}), 2
    )
    assert texts == [ch.text for ch in a.choices]
    assert usage == a.usage.model_dump()


def test_stop_string_is_cut_and_never_streamed(server):
    c = client(server)
    base = dict(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=24, temperature=0)
    full = c.completions.create(**base).choices[0].text
    # A stop string from the middle of the greedy text: everything from it on must vanish.
    stop = full[8:14]
    assert len(stop.strip()) >= 3, full
    expected = full[: full.index(stop)]
    r = c.completions.create(**base, stop=[stop, "@@never@@"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra is not None
    assert r.choices[0].model_extra["stop_reason"] == stop
    texts, finish, _ = _stream_text(c.completions.create(**base, stop=[stop], stream=True))
    # Equality of the joined chunks also proves no chunk carried part of the stop string.
    assert texts == [expected]
    assert finish == ["stop"]


def test_max_tokens_gives_length_and_ignore_eos_runs_to_it(server):
    c = client(server)
    r = c.completions.create(
        model="smollm2-135m-instruct",
        prompt="Hi",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 40


def test_logprobs_are_consistent(server):
    c = client(server)
    r = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0.0
        assert 3 <= len(top) <= 4  # the top 3, plus the chosen token when it is not among them
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()), abs=1e-6)
        assert chosen == top[token]
    streamed = c.completions.create(
        model="smollm2-135m-instruct",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        stream=True,
    )
    tokens, values = [], []
    for chunk in streamed:
        tokens += chunk.choices[0].logprobs.tokens
        values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt(server):
    c = client(server)
    n_prompt = token_count(server, prompt=PROMPT)
    r = c.completions.create(
        model="smollm2-135m-instruct",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=1,
    )
    plain = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=3, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    # max_tokens=0 with echo: the prompt and its logprobs only (how eval harnesses score text).
    only = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    assert only.choices[0].text == PROMPT
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(
        lp.token_logprobs[:n_prompt], abs=1e-5
    )
    assert only.usage.completion_tokens == 0


def test_tokenize_and_detokenize_round_trip(server):
    r = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}
    ).json()
    assert r["count"] == len(r["tokens"]) == 5
    assert r["max_model_len"] == 2048
    assert r["token_strs"][1] == "Ġcapital"
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}


def test_best_of_returns_the_most_likely_of_its_samples(server):
    c = client(server)
    base = dict(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9)
    best = c.completions.create(**base, n=1, best_of=3)
    # The same three samples (sample k draws with seed + k), with their logprobs.
    every = c.completions.create(**base, n=3, logprobs=0).choices
    totals = [sum(ch.logprobs.token_logprobs) for ch in every]
    assert len({ch.text for ch in every}) == 3
    (choice,) = best.choices
    assert choice.text == every[totals.index(max(totals))].text and choice.logprobs is None
    assert best.usage.completion_tokens == token_count(server, prompt=PROMPT + choice.text) - 5


def test_beam_search_equals_the_offline_engine(server, real_llm):
    from pagedserve.engine import BeamSearchParams

    c = client(server)
    r = c.completions.create(
        model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=8, n=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.8},
    )  # fmt: skip
    (offline,) = real_llm.beam_search(PROMPT, BeamSearchParams(3, 8, length_penalty=0.8))
    assert [ch.text for ch in r.choices] == [s.text for s in offline.sequences]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) == 3
    assert r.choices[0].text.startswith(" Paris")
