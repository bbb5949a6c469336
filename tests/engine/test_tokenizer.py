"""Tokenizer loading and prompt helpers, on the real SmolLM2 tokenizer from the GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.engine.models import tokenizer as tokenizer_module
from pagedserve.engine.models.builtin_shapes import builtin_config
from pagedserve.engine.models.hf_config import hf_dict_of
from pagedserve.engine.models.model_source import embedded_model_path, resolve_model
from pagedserve.engine.models.tokenizer import (
    apply_chat_template,
    encode_prompt,
    eos_token_ids,
    is_synthetic_tokenizer,
    load_tokenizer,
    normalize_messages,
    render_chat_prompt,
)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face
# <|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n
FRANCE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m-instruct")


def test_chat_template_equals_transformers(tok):
    ids = apply_chat_template(tok, FRANCE)
    assert ids == FRANCE_IDS
    # transformers 5 returns a BatchEncoding from its own tokenize=True path.
    reference = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    assert ids == list(reference["input_ids"])
    assert render_chat_prompt(tok, FRANCE) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = apply_chat_template(tok, FRANCE, add_generation_prompt=False)
    assert without_prompt == FRANCE_IDS[:-4]  # no "<|im_start|>assistant\n"


def test_text_parts_are_joined_with_newlines(tok):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert normalize_messages(parts) == joined
    assert apply_chat_template(tok, parts) == apply_chat_template(tok, joined)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]
    assert render_chat_prompt(tok, system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "at least one message"),
        ([{"role": "robot", "content": "hi"}], "messages\\[0\\].role 'robot' is not one of"),
        ([{"content": "hi"}], "messages\\[0\\].role None"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages\\[0\\].content\\[0\\] has type 'image_url'; only 'text'",
        ),
        ([{"role": "user", "content": 42}], "must be a string or a list of text parts"),
        (["hello"], "messages\\[0\\] must be an object"),
    ],
)
def test_bad_messages(tok, messages, message):
    with pytest.raises(ValueError, match=message):
        apply_chat_template(tok, messages)


def test_missing_or_failing_template(tok, monkeypatch):
    with pytest.raises(ValueError, match="chat template rejected the messages: no tools"):
        apply_chat_template(tok, FRANCE, chat_template="{{ raise_exception('no tools') }}")
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        apply_chat_template(tok, FRANCE)
    # An explicit template still works without the tokenizer's own.
    assert render_chat_prompt(tok, FRANCE, chat_template="{{ messages[0]['content'] }}") == (
        "What is the capital of France?"
    )


def test_encode_prompt_equals_tok_encode(tok):
    for text in ("Hello world", "The capital of France is", " leading space", "héllo 😀 日本語"):
        assert encode_prompt(tok, text) == tok.encode(text) == tok(text)["input_ids"]
    assert encode_prompt(tok, "Hello world") == [19556, 905]  # SmolLM2 adds no BOS
    assert encode_prompt(tok, "<|im_start|>") == [1]  # special tokens in text are recognised


def test_eos_token_ids(tok):
    config = builtin_config("smollm2-135m")
    assert eos_token_ids(tok, config) == (2,)
    other = builtin_config("llama-3.2-1b")
    assert eos_token_ids(tok, other) == (128001, 2)
    assert eos_token_ids(None, other) == (128001,)


def test_hf_folder_tokenizer_matches(tok, tmp_path: Path):
    tok.save_pretrained(tmp_path)
    folder_tok = load_tokenizer(tmp_path)
    assert apply_chat_template(folder_tok, FRANCE) == FRANCE_IDS
    assert encode_prompt(folder_tok, "héllo 😀 日本語") == encode_prompt(tok, "héllo 😀 日本語")


def test_where_tokenizers_come_from(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "")  # no cache: every GGUF load converts
    calls = []

    def fake_from_pretrained(path, **kwargs):
        calls.append((Path(path), kwargs))
        return "tokenizer"

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    gguf_path = embedded_model_path("smollm2-135m-instruct")
    (tmp_path / "tokenizer.json").write_text("{}")

    assert load_tokenizer("SmolLM2-135M-Instruct") == "tokenizer"
    assert load_tokenizer(gguf_path) == "tokenizer"
    assert load_tokenizer(tmp_path) == "tokenizer"
    shape = resolve_model("llama-3.2-1b")
    # A built-in shape has no tokenizer of its own: it gets a synthetic one, never from files.
    assert is_synthetic_tokenizer(load_tokenizer(shape))
    assert load_tokenizer(shape, "smollm2-135m-instruct") == "tokenizer"  # --tokenizer override
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text(json.dumps(hf_dict_of(shape.config)))
    assert is_synthetic_tokenizer(load_tokenizer(resolve_model(str(weights_only))))
    local = {"local_files_only": True, "trust_remote_code": False}
    gguf_call = (gguf_path.parent, {"gguf_file": gguf_path.name, **local})
    assert calls == [gguf_call, gguf_call, (tmp_path, local), gguf_call]

    with pytest.raises(ValueError, match="model 'no-such-model' not found"):
        load_tokenizer("no-such-model")
    # An explicit tokenizer location must hold a real tokenizer.
    with pytest.raises(ValueError, match="model 'llama-3.2-1b' has no tokenizer of its own"):
        load_tokenizer(shape, "llama-3.2-1b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(tmp_path / "empty")


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tok, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = embedded_model_path("smollm2-135m-instruct")
    calls = []
    real_from_pretrained = tokenizer_module.AutoTokenizer.from_pretrained

    def from_pretrained(path, **kwargs):
        calls.append("convert" if "gguf_file" in kwargs else "cached")
        if calls.count("convert") > 1 and "gguf_file" in kwargs:
            return tok  # converted once for real below; the others need not be
        return real_from_pretrained(path, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", from_pretrained)
    first = load_tokenizer(gguf_path)
    (folder,) = (tmp_path / "cache" / "tokenizers").iterdir()  # nothing left in staging
    assert (folder / "tokenizer.json").is_file()
    second = load_tokenizer("smollm2-135m-instruct")
    assert calls == ["convert", "cached"]
    # The cached tokenizer is the converted one: ids both ways, special tokens, chat template.
    text = "héllo 😀 日本語 <|im_start|>  two  spaces\n\nlines"
    for t in (first, second):
        assert type(t) is type(tok)
        assert apply_chat_template(t, FRANCE) == FRANCE_IDS
        assert t.encode(text) == tok.encode(text)
        assert t.decode(range(0, len(tok), 97)) == tok.decode(range(0, len(tok), 97))
        assert (t.eos_token, t.bos_token, t.all_special_ids) == (
            "<|im_end|>",
            "<|im_start|>",
            [1, 2, 0],
        )
        assert eos_token_ids(t, builtin_config("smollm2-135m")) == (2,)
        assert len(t) == len(tok) == 49152

    # A corrupt cached folder is converted again, and replaced.
    (folder / "tokenizer.json").write_text("not json")
    assert apply_chat_template(load_tokenizer(gguf_path), FRANCE) == FRANCE_IDS
    assert apply_chat_template(load_tokenizer(gguf_path), FRANCE) == FRANCE_IDS
    assert calls == ["convert", "cached", "cached", "convert", "cached"]
    # An unwritable cache only costs the conversion each time.
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "/proc/no-cache-here")
    assert apply_chat_template(load_tokenizer(gguf_path), FRANCE) == FRANCE_IDS
    assert calls[-1] == "convert"
