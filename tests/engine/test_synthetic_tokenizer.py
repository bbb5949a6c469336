"""The synthetic tokenizer that models without one get (built-in shapes, config.json files, HF
folders without tokenizer files), and `LLM` on a config.json file with dummy weights."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.builtin_shapes import builtin_config
from pagedserve.engine.models.hf_config import config_from_hf_dict
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.engine.models.tokenizer import (
    apply_chat_template,
    is_synthetic_tokenizer,
    load_tokenizer,
    render_chat_prompt,
    synthetic_tokenizer,
)
from tests.helpers import TINY_CONFIG_JSON  # 300 ids, bos 1, eos 2; 0 and 3..257 are bytes


def tiny_config(**overrides) -> ModelConfig:
    return config_from_hf_dict({**TINY_CONFIG_JSON, **overrides})


def expected_strings(config: ModelConfig) -> list[str]:
    """The documented scheme, written out independently: specials, 256 bytes, then "<id>"."""
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    strings = []
    num_bytes = 0
    for i in range(config.vocab_size):
        if i == config.bos_token_id:
            strings.append("<|endoftext|>" if i == eos else "<|bos|>")
        elif i == eos:
            strings.append("<|eos|>")
        elif i in config.eos_token_ids:
            strings.append(f"<|eos{config.eos_token_ids.index(i)}|>")
        elif num_bytes < 256:
            strings.append(f"<0x{num_bytes:02X}>")
            num_bytes += 1
        else:
            strings.append(f"<{i}>")
    return strings


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer(tiny_config())


@pytest.fixture(scope="module")
def qwen():
    """152k ids, bos == eos: the largest vocabulary of the built-in shapes (builds in ~0.3 s)."""
    return synthetic_tokenizer(builtin_config("qwen2.5-0.5b"))


def test_every_id_decodes_to_its_own_string(tok):
    strings = expected_strings(tiny_config())
    assert strings[:4] == ["<0x00>", "<|bos|>", "<|eos|>", "<0x01>"]
    assert strings[257:260] == ["<0xFF>", "<258>", "<259>"]
    assert [tok.decode([i]) for i in range(300)] == strings
    assert tok.convert_ids_to_tokens(list(range(300))) == strings
    assert len(set(strings)) == 300 and all(strings)
    assert len(tok) == 300
    assert is_synthetic_tokenizer(tok) and tok.is_synthetic is True


def test_decode_then_encode_gives_back_any_id_list(tok, qwen):
    rng = random.Random(0)
    for tokenizer, config in ((tok, tiny_config()), (qwen, builtin_config("qwen2.5-0.5b"))):
        strings = expected_strings(config)
        last = config.vocab_size - 1
        for _ in range(50):
            ids = [rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 30))]
            ids += [0, last, config.eos_token_ids[0]]
            rng.shuffle(ids)
            text = tokenizer.decode(ids)
            assert text == "".join(strings[i] for i in ids)
            assert tokenizer.encode(text) == ids
            assert tokenizer(text)["input_ids"] == ids


def test_special_tokens_and_no_bos_added(tok, qwen):
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (
        "<|bos|>",
        1,
        "<|eos|>",
        2,
    )
    assert tok.encode("<260>") == tok.encode("<260>", add_special_tokens=True) == [260]
    assert tok.encode("<|bos|><260><|eos|>") == [1, 260, 2]
    assert tok.decode([1, 260, 2, 261], skip_special_tokens=True) == "<260><261>"
    # bos == eos == 151643
    assert (qwen.bos_token_id, qwen.eos_token_id, qwen.eos_token) == (
        151643,
        151643,
        "<|endoftext|>",
    )
    # Several eos ids: the tokenizer's eos is the first, all are special; no bos in the config,
    # none here.
    config = tiny_config(bos_token_id=None, eos_token_id=[7, 9, 11])
    several = synthetic_tokenizer(config)
    assert (several.bos_token_id, several.eos_token_id) == (None, 7)
    assert [several.decode([i]) for i in range(300)] == expected_strings(config)
    assert several.decode([7, 9, 11, 8, 299]) == "<|eos|><|eos1|><|eos2|><0x07><299>"
    assert several.decode([7, 9, 11, 8], skip_special_tokens=True) == "<0x07>"
    assert several.encode("<|eos2|><|eos1|>") == [11, 9]


def test_any_text_falls_back_to_utf8_byte_tokens(tok):
    byte_ids = [0] + list(range(3, 258))  # byte b is byte_ids[b]
    text = "héllo 😀\n日本"
    ids = tok.encode(text)
    assert ids == [byte_ids[b] for b in text.encode("utf-8")]
    assert tok.decode(ids) == "".join(f"<0x{b:02X}>" for b in text.encode("utf-8"))
    # Token strings in text are their tokens; look-alikes that are not token strings (id 5 is a
    # byte token, leading zeros, ids past the vocabulary, lower-case hex) are bytes.
    assert tok.encode("a<260>b<|eos|>") == [byte_ids[ord("a")], 260, byte_ids[ord("b")], 2]
    for look_alike in ("<5>", "<0260>", "<300>", "<0x4a>"):
        assert tok.encode(look_alike) == [byte_ids[b] for b in look_alike.encode()], look_alike
    assert tok.encode("") == []


def test_a_vocabulary_too_small_for_byte_tokens_uses_unk():
    small = synthetic_tokenizer(tiny_config(vocab_size=40))
    assert small.decode(list(range(6))) == "<0><|bos|><|eos|><3><4><5>"
    assert small.encode("hé!") == [0, 0, 0]  # one unk (the lowest ordinary id) per character
    assert small.encode("<39><|eos|>") == [39, 2]


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
    assert render_chat_prompt(tok, messages) == prompt
    assert apply_chat_template(tok, messages) == tok.encode(prompt)
    assert len(apply_chat_template(tok, messages)) == len(prompt.encode("utf-8")) == 44
    assert render_chat_prompt(tok, messages, add_generation_prompt=False) == prompt.removesuffix(
        "<|assistant|>"
    )


def test_load_tokenizer_warns_and_files_win(tok, caplog, tmp_path: Path):
    source = resolve_model("smollm2-135m")
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.models.tokenizer"):
        synthetic = load_tokenizer(source)
    assert is_synthetic_tokenizer(synthetic) and len(synthetic) == 49152
    assert synthetic.name_or_path == "synthetic:smollm2-135m"
    assert caplog.messages == [
        "model 'smollm2-135m' has no tokenizer: using a synthetic one over its 49152 token ids; "
        "text in and out is not the real model's; pass --tokenizer DIR for real text"
    ]
    # Tokenizer files, here the tiny synthetic tokenizer saved to a folder, are a real tokenizer.
    tok.save_pretrained(tmp_path / "tok")
    override = load_tokenizer(source, tmp_path / "tok")  # --tokenizer DIR
    assert not is_synthetic_tokenizer(override) and len(override) == 300
    assert override.encode("<260><|eos|>h") == [260, 2, ord("h") + 2]
    # A config.json next to tokenizer files: those are the model's tokenizer.
    (tmp_path / "tok" / "config.json").write_text(json.dumps(TINY_CONFIG_JSON))
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.models.tokenizer"):
        beside = load_tokenizer(resolve_model(str(tmp_path / "tok" / "config.json")))
    assert not is_synthetic_tokenizer(beside) and len(beside) == 300
    assert len(caplog.messages) == 1  # no second warning


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("tiny-config") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG_JSON))
    return LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64)


def test_llm_on_a_config_json_file_with_dummy_weights(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    assert is_synthetic_tokenizer(tok)
    assert tiny_llm.engine.core.source.kind == "dummy"
    params = SamplingParams(**_greedy(10))
    prompt_ids = [258, 7, 299, 0, 100]
    (out,) = tiny_llm.generate([prompt_ids], params)
    ids = out.outputs[0].token_ids
    assert len(ids) == 10
    strings = expected_strings(tiny_config())

    def visible(token_ids: list[int]) -> str:  # text skips the special tokens bos 1 and eos 2
        return "".join(strings[i] for i in token_ids if i not in (1, 2))

    assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True) == visible(ids)
    # The decoded prompt is the same prompt, so it continues the same way.
    (from_text,) = tiny_llm.generate(tok.decode(prompt_ids), params)
    assert from_text.prompt_token_ids == prompt_ids
    assert from_text.outputs[0].token_ids == ids
    # A stop string made of the third token's string ends the text just before it.
    assert ids[2] not in (1, 2)
    (stopped,) = tiny_llm.generate(
        [prompt_ids], SamplingParams(**_greedy(10), stop=[strings[ids[2]]])
    )
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].text == visible(ids[: ids.index(ids[2])])


def test_llm_chat_on_a_config_json_file(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    (out,) = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**_greedy(4)))
    # One byte token per character; byte b is id b + 2 here (ids 1 and 2 are bos and eos).
    assert out.prompt_token_ids == [b + 2 for b in b"<|user|>hi\n<|assistant|>"]
    assert len(out.prompt_token_ids) == 24
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
