"""A real server on a bare config.json: dummy weights and the synthetic tokenizer. Token-id and
chat requests through the official openai client agree exactly with /tokenize, /detokenize and
the offline engine. (`bench serve` against it: tests/bench/test_serve_stats.py.)"""

from __future__ import annotations

import httpx

from pagedserve.engine import LLM, SamplingParams
from tests.server.util import RunningServer, client, token_count

PROMPT_IDS = [300, 5, 10239, 0, 2000]
# "<|user|>hi\n<|assistant|>": the synthetic chat template, one byte token per character.
CHAT_PROMPT_TOKENS = 24


def _post(server: RunningServer, path: str, **body) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def _ids_of(server: RunningServer, text: str) -> list[int]:
    return _post(server, "/tokenize", prompt=text)["tokens"]


def test_the_server_says_its_tokenizer_is_synthetic(dummy_server, dummy_config_file):
    assert (
        f"model '{dummy_config_file}' has no tokenizer: using a synthetic one over its 10240 "
        "token ids" in dummy_server.log()
    )
    (card,) = client(dummy_server).models.list().data
    assert card.id == str(dummy_config_file)


def test_completion_from_token_ids(dummy_server, dummy_config_file):
    response = client(dummy_server).completions.create(
        model=str(dummy_config_file),
        prompt=PROMPT_IDS,
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    (choice,) = response.choices
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 8)
    ids = _ids_of(dummy_server, choice.text)
    assert len(ids) == 8
    assert _post(dummy_server, "/detokenize", tokens=ids)["prompt"] == choice.text
    assert choice.logprobs.tokens == [
        _post(dummy_server, "/detokenize", tokens=[i])["prompt"] for i in ids
    ]
    assert "".join(choice.logprobs.tokens) == choice.text
    # The offline engine on the same config.json and seed samples the same tokens.
    llm = LLM(model=str(dummy_config_file), device="cpu", dtype="float32", num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (offline,) = llm.generate([PROMPT_IDS], params)
    assert offline.outputs[0].token_ids == ids
    assert offline.outputs[0].text == choice.text
    # The text of the prompt ids is the same prompt.
    prompt_text = _post(dummy_server, "/detokenize", tokens=PROMPT_IDS)["prompt"]
    assert prompt_text == "<300><0x03><10239><0x00><2000>"
    from_text = client(dummy_server).completions.create(
        model=str(dummy_config_file),
        prompt=prompt_text,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert from_text.usage.prompt_tokens == 5
    assert from_text.choices[0].text == choice.text


def test_chat_completion_and_its_stream(dummy_server, dummy_config_file):
    messages = [{"role": "user", "content": "hi"}]
    assert token_count(dummy_server, messages=messages) == CHAT_PROMPT_TOKENS
    kwargs = dict(
        model=str(dummy_config_file),
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    response = client(dummy_server).chat.completions.create(**kwargs)
    content = response.choices[0].message.content
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        CHAT_PROMPT_TOKENS,
        6,
    )
    ids = _ids_of(dummy_server, content)
    assert len(ids) == 6
    assert _post(dummy_server, "/detokenize", tokens=ids)["prompt"] == content
    stream = client(dummy_server).chat.completions.create(**kwargs, stream=True)
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta]
    assert "".join(d for d in deltas if d) == content
