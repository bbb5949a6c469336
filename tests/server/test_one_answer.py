"""One request, one answer, through a server started as a user starts it (`pagedserve serve` with
no flags: the embedded SmolLM2 GGUF kept quantized, `--dtype auto`): at temperature 0 a request's
tokens and logprobs are the same, bit for bit, however it is served: first or from the prefix
cache, alone or among 15 others, streamed or not, as one of n = 3, among a list of prompts or
alone, and in a server that prefills 16 tokens a step. tests/engine/test_lesser_cpu.py runs this
module at the avx2 level too (float32 there); tests/kernels/test_batch_invariance.py shows each
op's part.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.util import RunningServer, client, run_server

README_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "Once upon a time", "The quick brown fox", "In 1492, Columbus", "def fibonacci(n):",
    "The best way to learn a language is", "Water boils at", "My favourite food is",
    "The three primary colours are",
]  # fmt: skip
# A long prompt: 300 tokens or so, prefilled in several steps of the short-chunk server.
LONG_PROMPT = " ".join(
    f"Item {i}: the {w} of the river rises in spring and falls in autumn."
    for i, w in enumerate(["level", "colour", "speed", "sound", "smell"] * 5)
)
MAX_TOKENS = 16
MODEL = "smollm2-135m-instruct"  # the default model's name


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> Iterator[RunningServer]:
    with run_server(tmp_path_factory.mktemp("default") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def short_chunk_server(tmp_path_factory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("short-chunks") / "server.log"
    # A small KV pool: the default (4 GiB) beside the default server's would crowd a 24 GiB CI
    # machine; the pool's size changes no arithmetic.
    with run_server(log, "--max-num-batched-tokens", "16", "--kv-cache-memory", "0.5") as s:
        yield s


def _chat(server: RunningServer, n: int = 1, stream: bool = False) -> list[tuple]:
    """Each choice's (tokens as text pieces, their logprobs, their top 5)."""
    c = client(server, timeout=300)
    args = dict(model=MODEL, messages=README_CHAT, temperature=0, max_tokens=MAX_TOKENS,
                logprobs=True, top_logprobs=5, n=n)  # fmt: skip
    if stream:
        pieces: dict[int, list] = {}
        for chunk in c.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    pieces.setdefault(choice.index, []).extend(choice.logprobs.content)
        contents = [pieces[i] for i in sorted(pieces)]
    else:
        reply = c.chat.completions.create(**args)
        contents = [choice.logprobs.content for choice in reply.choices]
    return [
        tuple(
            (t.token, t.logprob, tuple((a.token, a.logprob) for a in t.top_logprobs))
            for t in content
        )  # fmt: skip
        for content in contents
    ]


def _completions(server: RunningServer, prompts: list[str]) -> list[tuple]:
    """Each prompt's (tokens, logprobs, top 5 per token), the prompts in one request."""
    reply = client(server, timeout=300).completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=MAX_TOKENS, logprobs=5
    )
    choices = sorted(reply.choices, key=lambda c: c.index)
    return [
        (
            tuple(c.logprobs.tokens),
            tuple(c.logprobs.token_logprobs),
            tuple(tuple(sorted(top.items())) for top in c.logprobs.top_logprobs),
        )  # fmt: skip
        for c in choices
    ]


def _among_others(server: RunningServer, task, others: int = 15):
    """task() sent with `others` other requests at once (the other prompts, 16 tokens each)."""

    def other(i: int) -> None:
        client(server, timeout=300).completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
            temperature=0, max_tokens=16,
        )  # fmt: skip

    with ThreadPoolExecutor(others + 1) as pool:
        rest = [pool.submit(other, i) for i in range(others // 2)]
        mine = pool.submit(task)
        rest += [pool.submit(other, i) for i in range(others // 2, others)]
        for future in rest:
            future.result()
        return mine.result()


def test_the_readme_chat_answers_the_same_however_it_is_served(default_server, short_chunk_server):
    (first,) = _chat(default_server)
    assert "".join(token for token, _, _ in first).startswith("The capital of France is Paris.")
    for _ in range(3):  # its prompt now comes from the prefix cache
        assert _chat(default_server) == [first]
    assert _among_others(default_server, lambda: _chat(default_server)) == [first]
    assert _chat(default_server, stream=True) == [first]
    assert _chat(default_server, n=3) == [first] * 3
    # Prefilled 16 tokens a step, its decodes beside other requests' chunks.
    assert _chat(short_chunk_server) == [first]
    assert _among_others(short_chunk_server, lambda: _chat(short_chunk_server)) == [first]


def test_prompts_answer_the_same_batched_and_alone(default_server, short_chunk_server):
    batched = _completions(default_server, PROMPTS)
    assert [_completions(default_server, [p])[0] for p in PROMPTS] == batched
    assert _completions(short_chunk_server, PROMPTS) == batched
    (alone,) = _completions(default_server, [PROMPTS[0]])
    among = _among_others(default_server, lambda: _completions(default_server, [PROMPTS[0]]))
    assert among == [alone]


def test_a_long_prompt_answers_the_same_cold_cached_and_chunked(default_server, short_chunk_server):
    (cold,) = _completions(default_server, [LONG_PROMPT])
    assert len(cold[0]) == MAX_TOKENS
    assert _completions(default_server, [LONG_PROMPT]) == [cold]  # its blocks from the cache
    assert _completions(short_chunk_server, [LONG_PROMPT]) == [cold]
