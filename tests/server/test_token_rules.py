"""logit_bias, min_tokens, bad_words and allowed_token_ids, `suffix` (fill-in-the-middle) and
chat's prompt_logprobs over HTTP, through the official openai client against the real SmolLM2
server (and, for `suffix`, a dummy model with a tokenizer that has FIM tokens)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.util import client, run_server

MODEL = "smollm2-135m-instruct"
CAPITAL = "The capital of France is"
SUM_CHAT = [{"role": "user", "content": "What is 2+2? Reply with just the number."}]


def _ids(server, text: str) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def test_logit_bias_forces_and_bans_tokens(server):
    c = client(server)
    (paris,) = _ids(server, " Paris")
    forced = c.completions.create(
        model=MODEL, prompt=CAPITAL, max_tokens=4, temperature=1.0, seed=3, n=2,
        logit_bias={str(paris): 100},
    )  # fmt: skip
    assert [ch.text for ch in forced.choices] == [" Paris" * 4] * 2
    plain = c.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=5, temperature=0)
    assert plain.choices[0].text.startswith(" Paris")
    banned = c.completions.create(
        model=MODEL, prompt=CAPITAL, max_tokens=5, temperature=0, logprobs=0,
        logit_bias={str(paris): -100},
    )  # fmt: skip
    tokens = banned.choices[0].logprobs.tokens
    assert len(tokens) == 5 and " Paris" not in tokens
    assert banned.choices[0].text != plain.choices[0].text


def test_min_tokens_holds_eos_back_and_leaves_ignore_eos_alone(server):
    c = client(server)

    def ask(**extra):
        r = c.chat.completions.create(
            model=MODEL, messages=SUM_CHAT, max_tokens=12, temperature=0, extra_body=extra
        )
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    assert ask() == ("2 + 2 = 4", "stop", 8)  # seven tokens, then EOS
    text, finish, count = ask(min_tokens=10)
    assert text.startswith("2 + 2 = 4") and len(text) > len("2 + 2 = 4")
    assert count >= 10 and (finish, count) != ("stop", 10)
    # With ignore_eos nothing was going to stop it: min_tokens changes nothing.
    assert ask(ignore_eos=True, min_tokens=10) == ask(ignore_eos=True)


def test_bad_words_never_appear(server):
    c = client(server)
    plain = c.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=6, temperature=0)
    assert "Paris" in plain.choices[0].text
    r = c.completions.create(
        model=MODEL, prompt=CAPITAL, max_tokens=6, temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )  # fmt: skip
    assert "Paris" not in r.choices[0].text and r.usage.completion_tokens == 6


def test_allowed_token_ids_limit_every_token(server):
    words = [" yes", " no", " maybe"]
    allowed = [_ids(server, w)[0] for w in words]
    assert [_ids(server, w) for w in words] == [[i] for i in allowed]
    r = client(server).completions.create(
        model=MODEL, prompt=CAPITAL, max_tokens=8, temperature=1.0, seed=7, logprobs=0, n=2,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    for choice in r.choices:
        assert len(choice.logprobs.tokens) == 8 and set(choice.logprobs.tokens) <= set(words)
    assert r.choices[0].text != r.choices[1].text


def test_chat_prompt_logprobs_are_the_prompts(server):
    body = {"model": MODEL, "messages": SUM_CHAT, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{server.v1}/chat/completions", json={**body, "prompt_logprobs": 2}, timeout=60)
    r.raise_for_status()
    chat = r.json()
    prompt_ids = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL, "messages": SUM_CHAT}, timeout=30
    ).json()["tokens"]
    table = chat["prompt_logprobs"]
    assert len(table) == len(prompt_ids) == chat["usage"]["prompt_tokens"] and table[0] is None
    # The same numbers as the completions API's echo of that prompt.
    echo = client(server).completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    echoed = echo.choices[0].logprobs.token_logprobs[: len(prompt_ids)]
    for token_id, entry, expected in zip(prompt_ids[1:], table[1:], echoed[1:], strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-4)
        # The top 2, and the prompt's token when it is not among them.
        assert 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    # Not asked: not there.
    plain = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        ("completions", {"logit_bias": {"49152": 1}}, "logit_bias", "outside the vocabulary"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
        ("completions", {"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ("completions", {"min_tokens": 17}, "min_tokens", "in [0, max_tokens (16)]"),
        ("completions", {"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ("completions", {"allowed_token_ids": [60000]}, "allowed_token_ids", "vocabulary"),
        ("completions", {"bad_words": [""]}, "bad_words", "non-empty strings"),
        ("completions", {"suffix": "x"}, "suffix", f"`{MODEL}` has no FIM tokens"),
        ("completions", {"suffix": "x", "echo": True}, "echo", "combined with suffix"),
        (
            "completions",
            {"use_beam_search": True, "n": 2, "temperature": 0, "logit_bias": {"5": 1}},
            "logit_bias",
            "not supported with use_beam_search",
        ),
        ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "cannot be streamed"),
        ("chat", {"prompt_logprobs": 21}, "prompt_logprobs", "in [0, 20]"),
        (
            "chat",
            {"min_tokens": 2, "response_format": {"type": "json_object"}},
            "min_tokens",
            "structured outputs",
        ),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, path, fields, param, message):
    if path == "chat":
        url, body = f"{server.v1}/chat/completions", {"messages": SUM_CHAT}
    else:
        url, body = f"{server.v1}/completions", {"prompt": CAPITAL}
    r = httpx.post(url, json={"model": MODEL, **body, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


# ---- suffix on a model whose tokenizer has FIM tokens ------------------------------------------

FIM_SPECIALS = ["<fim_prefix>", "<fim_middle>", "<|endoftext|>", "<fim_suffix>"]  # ids 0..3


@pytest.fixture(scope="module")
def fim_server(dummy_config_file, tmp_path_factory):
    """The dummy model with a byte-level tokenizer holding StarCoder's FIM tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("fim-tokenizer")
    vocab = {token: i for i, token in enumerate(FIM_SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in FIM_SPECIALS]
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    log_path = tmp_path_factory.mktemp("fim-server") / "server.log"
    with run_server(
        log_path, "--model", str(dummy_config_file), "--tokenizer", str(folder),
        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "0.01",
    ) as s:  # fmt: skip
        yield s


def test_suffix_makes_a_fill_in_the_middle_prompt(fim_server, dummy_config_file):
    c = client(fim_server)
    model = str(dummy_config_file)
    prefix, middle, suffix = 0, 1, 3
    prompts = ["def f(", "x = "]
    r = c.completions.create(
        model=model, prompt=prompts, suffix="return 1", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    tail = _ids(fim_server, "return 1")
    assert len(tail) == len("return 1")  # one byte, one token
    for index, text in enumerate(prompts):
        # Prefix, suffix, middle: the model writes what goes between.
        psm = [prefix, *_ids(fim_server, text), suffix, *tail, middle]
        same = c.completions.create(
            model=model, prompt=psm, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[index].text == same.choices[0].text
        assert same.usage.prompt_tokens == len(psm)
    assert r.usage.prompt_tokens == sum(len(text) + len(tail) + 3 for text in prompts)
