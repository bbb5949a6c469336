"""POST /v1/chat/completions against a real server with the real SmolLM2 and its chat template."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.scheduler import SamplingParams
from tests.server.util import client, sse_events, stream_choices, token_count

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _collect(chunks, num_choices: int = 1):
    pieces, finish, usage = stream_choices(chunks, "chat.completion.chunk", num_choices)
    for first in (choice[0] for choice in pieces if choice):
        # The first chunk of each choice carries the role and no text yet.
        assert first.delta.role == "assistant"
        assert not first.delta.content
    texts = ["".join(c.delta.content or "" for c in choice) for choice in pieces]
    roles = [choice[0].delta.role if choice else None for choice in pieces]
    return texts, roles, finish, usage


def test_chat_answers_paris_like_the_offline_engine(server, real_llm):
    c = client(server)
    r = c.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=30, temperature=0
    )
    offline = real_llm.chat(MESSAGES, SamplingParams(max_tokens=30, temperature=0))[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline.outputs[0].text
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # SmolLM2 ends its answer with <|im_end|>
    assert r.usage.prompt_tokens == token_count(server, messages=MESSAGES)
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.outputs[0].token_ids)


def test_streamed_chat_equals_non_streamed(server):
    c = client(server)
    kwargs = dict(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=30, temperature=0)
    whole = c.chat.completions.create(**kwargs)
    texts, roles, finish, usage = _collect(
        c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert texts == [whole.choices[0].message.content]
    assert roles == ["assistant"]
    assert finish == [whole.choices[0].finish_reason]
    assert usage == whole.usage.model_dump()


def test_chat_sse_bytes(server):
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_max_completion_tokens_and_text_parts(server):
    c = client(server)
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    r = c.chat.completions.create(
        model="smollm2-135m-instruct", messages=parts, max_completion_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    flat = [{"role": m["role"], "content": m["content"][0]["text"]} for m in parts]
    assert r.usage.prompt_tokens == token_count(server, messages=flat)


def test_chat_n2_seeded_and_streamed(server):
    c = client(server)
    kwargs = dict(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=7,
    )
    a = c.chat.completions.create(**kwargs)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert a.choices[0].message.content != a.choices[1].message.content
    texts, roles, _, _ = _collect(c.chat.completions.create(**kwargs, stream=True), 2)
    assert texts == [ch.message.content for ch in a.choices]
    assert roles == ["assistant", "assistant"]


def test_chat_stop_string(server):
    c = client(server)
    base = dict(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=30, temperature=0)
    full = c.chat.completions.create(**base).choices[0].message.content
    assert "Paris" in full
    r = c.chat.completions.create(**base, stop=["Paris"])
    assert r.choices[0].message.content == full[: full.index("Paris")]
    assert r.choices[0].finish_reason == "stop"
    texts, _, finish, _ = _collect(c.chat.completions.create(**base, stop=["Paris"], stream=True))
    assert texts == [full[: full.index("Paris")]]
    assert finish == ["stop"]


def test_chat_logprobs(server):
    c = client(server)
    body = dict(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=6, temperature=0)
    r = c.chat.completions.create(**body, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        # Greedy: the chosen token is the top one.
        assert t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.bytes == list(t.token.encode())
    streamed = c.chat.completions.create(**body, logprobs=True, top_logprobs=2, stream=True)
    tokens = [
        t.token
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_chat_beam_search(server, real_llm):
    from pagedserve.engine import BeamSearchParams
    from pagedserve.engine.models.tokenizer import apply_chat_template

    c = client(server)
    r = c.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=8, n=2,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    prompt = apply_chat_template(real_llm.get_tokenizer(), MESSAGES)
    (offline,) = real_llm.beam_search([prompt], BeamSearchParams(2, 8))
    assert [ch.message.content for ch in r.choices] == [s.text for s in offline.sequences]
    assert "Paris" in r.choices[0].message.content
