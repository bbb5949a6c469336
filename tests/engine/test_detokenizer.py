"""Incremental detokenization (real SmolLM2 byte-level BPE tokenizer) and stop strings."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.frontend.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from pagedserve.engine.models.tokenizer import apply_chat_template, load_tokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "héllo wörld — naïve café, señor, Ærøskøbing",
    "😀🎉 emoji 👨‍👩‍👧 family 🇫🇷 flag",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "mixed: añb 😀 日本 ok\n\n  indented\tline",
    "Ελληνικά и кириллица, עברית, العربية",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return apply_chat_template(tok, [{"role": "user", "content": "Say something."}])


def stream(tok, prompt_ids, output_ids, chunk=1, **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = [detok.add_tokens(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas, detok.output_text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_decode(tok, prompt_ids, text, chunk):
    ids = tok.encode(text)
    deltas, out = stream(tok, prompt_ids, ids, chunk)
    assert out == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing left to flush for valid text


def test_characters_split_across_tokens_are_held_back(tok, prompt_ids):
    ids = tok.encode("héllo 😀 日本語")
    # ['h', 'Ã©', 'llo', 'ĠðŁĺ', 'Ģ', 'Ġæ', 'Ĺ', '¥', 'æľ¬', 'è', 'ª', 'ŀ']: the emoji and two
    # of the CJK characters are split over 2-3 byte-level tokens.
    assert len(ids) == 12 and tok.decode(ids[3:4]).endswith("\ufffd")
    deltas, _ = stream(tok, prompt_ids, ids)
    assert deltas == ["h", "é", "llo", "", " 😀", "", "", " 日", "本", "", "", "語", ""]


def test_special_tokens_skipped_or_kept(tok, prompt_ids):
    ids = tok.encode("Paris is the capital.") + [2] + tok.encode(" And 😀") + [1, 2]
    deltas, out = stream(tok, prompt_ids, ids)
    assert out == tok.decode(ids, skip_special_tokens=True) == "Paris is the capital. And 😀"
    _, kept = stream(tok, prompt_ids, ids, skip_special_tokens=False)
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert kept == "Paris is the capital.<|im_end|> And 😀<|im_start|><|im_end|>"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok, prompt_ids):
    emoji_head = tok.encode(" 😀")[:1]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert detok.add_tokens(emoji_head) == ""
    assert detok.output_text == ""
    assert detok.flush() == " \ufffd" == tok.decode(emoji_head)
    assert detok.num_output_tokens == 1


def test_empty_prompt_and_no_tokens(tok):
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens([]) == "" and detok.output_text == ""
    assert detok.add_tokens(tok.encode("Hi there")) == "Hi there"


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.window_sizes = tok, []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_work_per_token_is_constant(tok, prompt_ids):
    ids = tok.encode(" ".join(TEXTS) * 3)
    assert len(ids) > 300
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids)
    for token_id in ids:
        detok.add_tokens([token_id])
    assert detok.output_text == tok.decode(ids)
    # Two decodes per token at most (plus the prompt context), each of a few tokens: the window
    # is the previous step's tokens plus any held-back bytes of one character (<= 4 tokens).
    assert len(counting.window_sizes) <= 2 * len(ids) + 1
    assert max(counting.window_sizes) <= 8


def test_the_rust_decode_shortcut_equals_transformers_decode(tok):
    from pagedserve.engine.frontend.detokenizer import _backend_decode

    backend = _backend_decode(tok)
    assert backend is not None  # SmolLM2's tokenizer takes the shortcut
    ids = tok.encode(" ".join(TEXTS)) + [tok.eos_token_id, 0, 1, 2]
    rng = random.Random(0)
    windows = [ids] + [ids[i : i + rng.randrange(1, 9)] for i in range(0, len(ids), 3)]
    for skip in (True, False):
        for window in windows:
            assert backend(window, skip) == tok.decode(window, skip_special_tokens=skip)
    # A wrapper whose class overrides decode keeps the wrapper (CountingTokenizer above).
    assert _backend_decode(CountingTokenizer(tok)) is None


# ---------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    "text, stops, checked_from, expected",
    [
        ("Hello world. Bye", ["."], 5, (11, ".")),
        ("abc STOP xyz END", ["END", "STOP"], 0, (4, "STOP")),  # earliest wins, not list order
        ("foo STOP", ["STOP"], 6, (4, "STOP")),  # starts in checked text, ends in new text
        ("STOP and more", ["STOP"], 9, None),  # wholly in checked text: not searched again
        ("xabcd", ["ab", "abc"], 0, (1, "abc")),  # same start: the longest
        ("xabcd", ["", "cd"], 0, (3, "cd")),  # empty stop strings are ignored
        ("abc", ["c"], 3, None),  # no new text
        ("abc", [], 0, None),
    ],
)
def test_find_stop(text, stops, checked_from, expected):
    assert find_stop(text, stops, checked_from) == expected


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("Hello wor", ["world"], 3),
        ("Hello", ["lo!", "llo?"], 3),
        ("abc", ["x"], 0),  # a 1-char stop is found, never held back
        ("", ["abc"], 0),
        ("a", ["aab"], 1),
        ("aa", ["aab"], 2),
        ("xaab", ["aab"], 0),  # a whole stop string is find_stop's business
        ("Hello ", ["world", " wo"], 1),
    ],
)
def test_stop_holdback(text, stops, expected):
    assert stop_holdback(text, stops) == expected


def test_streaming_with_holdback_and_stop():
    """What a streaming response shows after each delta."""
    stops = ["world"]
    text, shown = "", []
    for delta in ["Hel", "lo wo", "rl", "d! more"]:
        checked_from, text = len(text), text + delta
        hit = find_stop(text, stops, checked_from)
        if hit is not None:
            shown.append(text[: hit[0]])
            break
        shown.append(text[: len(text) - stop_holdback(text, stops)])
    assert shown == ["Hel", "Hello ", "Hello ", "Hello "]
