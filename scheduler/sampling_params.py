"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import dataclasses
import json as _json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# OpenAI caps `logprobs` (number of alternatives per position) at 20.
MAX_LOGPROBS = 20
# Integers are signed 64-bit, as a seed is in the OpenAI API and vLLM (and msgpack, the core
# process's wire format, carries no more).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Temperatures below this sample as greedy (as in vLLM): dividing float32 logits by less
# overflows them to infinity, and the draw is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

# Float fields: (name, low, low bound excluded, high, wording of the allowed range).
_FLOAT_FIELDS: tuple[tuple[str, float | None, bool, float | None, str], ...] = (
    ("temperature", 0.0, False, None, ">= 0"),
    ("top_p", 0.0, True, 1.0, "in (0, 1]"),
    ("min_p", 0.0, False, 1.0, "in [0, 1]"),
    ("presence_penalty", -2.0, False, 2.0, "in [-2, 2]"),
    ("frequency_penalty", -2.0, False, 2.0, "in [-2, 2]"),
    ("repetition_penalty", 0.0, True, None, "> 0"),
    ("length_penalty", None, False, None, "finite"),
)


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `max_tokens=True` is a bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    range_text: str,
) -> float:
    """Check that `value` is a finite real number in a range; return it as a float.

    `range_text` is the human wording of the allowed range, e.g. "in (0, 1]".
    """
    if not _is_number(value):
        raise ValueError(f"{name} must be a number {range_text}, got {value!r}")
    number = float(value)
    ok = math.isfinite(number)
    if ok and low is not None:
        ok = number > low if low_open else number >= low
    if ok and high is not None:
        ok = number <= high
    if not ok:
        raise ValueError(f"{name} must be {range_text}, got {value!r}")
    return number


def _normalise_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items: Iterable[Any] = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    stop = tuple(items)
    for item in stop:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r}")
    return stop


def _normalise_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, Iterable) or isinstance(value, str | bytes):
        raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {value!r}")
    ids = tuple(value)
    for token_id in ids:
        if not _is_int(token_id) or not 0 <= token_id <= INT64_MAX:
            raise ValueError(
                f"stop_token_ids must contain only ints in [0, {INT64_MAX}], got {token_id!r}"
            )
    return ids


def _normalise_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) as sorted pairs; biases in [-100, 100]."""
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        pairs = None
    if pairs is None or not all(len(p) == 2 for p in pairs):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    out: dict[int, float] = {}
    for token_id, bias in pairs:
        if not _is_int(token_id) or not 0 <= token_id <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
        if not _is_number(bias) or not -100.0 <= float(bias) <= 100.0:  # (NaN fails too)
            raise ValueError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token "
                f"{token_id}"
            )
        out[token_id] = float(bias)
    return tuple(sorted(out.items()))


OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the text a request generates (vLLM's StructuredOutputsParams): exactly one
    of a JSON schema (`json`, kept as compact JSON text, so equal schemas compare and hash
    equal), any JSON object (`json_object`), a regular expression, a choice among strings, or
    an EBNF grammar (xgrammar's dialect: `root ::= ...`). A schema's properties keep their
    order: the output lists them in it.

    Checked here for shape only; whether the engine's grammar library can build it is checked
    where the request enters the engine (engine/structured_output.py `check`).

    `reasoning_end` (a reasoning model's `</think>`): the constraint applies to the text after
    it; until the output has written it, every token is allowed (vLLM's `reasoning_ended`).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    f"a JSON schema must be an object (or true/false), got {self.json!r}"
                )
            set_field(self, "json", _json.dumps(schema, separators=(",", ":")))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choice, Iterable):
                raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
            choice = tuple(choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    f"choice must be a non-empty list of non-empty strings, got {self.choice!r}"
                )
            set_field(self, "choice", choice)
        if len(self.kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice and "
                f"grammar, got {', '.join(self.kinds) or 'none'}"
            )

    @property
    def kinds(self) -> list[str]:
        """The constraints that are set (exactly one, once constructed)."""
        return [
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) not in (None, False)
        ]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Validated in `__post_init__`: every invalid field raises ValueError naming the field,
    the offending value and the allowed range. Numeric floats are stored as `float`,
    `stop` and `stop_token_ids` as tuples (a single string or a list is accepted), so the
    object is hashable and safe to share between requests.

    `n` is carried for the engine, which fans a request out into `n` sequences; the
    scheduler treats every `Request` as exactly one sequence.

    `best_of` samples that many sequences and returns the `n` with the highest cumulative
    logprob. `use_beam_search` returns the `n` best beams of a beam search of width `n` instead
    of sampling, ranked by cumulative logprob / (generated length ** length_penalty); the
    sampling knobs (temperature, top_p, top_k, min_p, seed) do not apply to it.
    """

    n: int = 1
    best_of: int | None = None  # None = n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off, else keep the k most likely tokens
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = off; k = top-k alternatives besides the chosen token
    # None = off; k = per prompt position after the first, its token's logprob plus the top k.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search: scores are divided by length ** length_penalty
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (None = free text).
    structured_outputs: StructuredOutputs | None = None
    # What each engine output carries (vLLM's RequestOutputKind): "cumulative" = everything so
    # far, every step; "delta" = only what is new since the previous output (streaming, the
    # server); "final" = one output, when the request finishes (the offline LLM API).
    output_kind: str = "cumulative"
    # vLLM's extras that shape which tokens may be sampled (the sampler applies them to the
    # logits, before penalties and temperature; logprobs stay the model's, as vLLM's default
    # "raw_logprobs"). The token-id ones must be inside the vocabulary: the engine's front end
    # checks that (`check_token_ids`), since only it knows the model.
    # EOS and stop_token_ids cannot be sampled, and stop strings do not end the output, before
    # this many output tokens.
    min_tokens: int = 0
    # {token id: bias in [-100, 100]} added to the logits (a dict or pairs in; stored as sorted
    # (id, bias) pairs so the params stay hashable). +-100 in effect forces or bans a token.
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Only these token ids may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never to generate. The front end tokenizes each (with and without a leading space)
    # into `bad_words_token_ids`: a word of one token is banned outright, a longer one has its
    # last token banned when the output ends with the rest of it.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # object.__setattr__ because the dataclass is frozen; normalising here keeps
        # every consumer free of "str or list?" and "int or float?" checks.
        set_field = object.__setattr__
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name, low, low_open, high, range_text in _FLOAT_FIELDS:
            value = _check_number(
                name,
                getattr(self, name),
                low=low,
                low_open=low_open,
                high=high,
                range_text=range_text,
            )
            set_field(self, name, value)
        if not _is_int(self.top_k) or not (-1 <= self.top_k <= INT64_MAX):
            raise ValueError(
                f"top_k must be -1 or 0 (off) or an int in [1, {INT64_MAX}], got {self.top_k!r}"
            )
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(
                f"max_tokens must be an int in [1, {INT64_MAX}], got {self.max_tokens!r}"
            )
        set_field(self, "stop", _normalise_stop(self.stop))
        set_field(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        if self.seed is not None and (
            not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise ValueError(
                f"seed must be None or an int in [{INT64_MIN}, {INT64_MAX}] (signed 64 bits), "
                f"got {self.seed!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(
                f"output_kind must be one of {list(OUTPUT_KINDS)}, got {self.output_kind!r}"
            )
        for name in (
            "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search"
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}"
            )
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(
                f"best_of must be None or an int >= n ({self.n}), got {self.best_of!r}"
            )
        self._check_token_rules()
        if self.use_beam_search:
            self._check_beam_search()
        elif self.num_samples > 1 and self.best_of is not None and self.greedy:
            raise ValueError(
                f"best_of ({self.best_of}) needs sampling: with temperature 0 every sample is "
                "the same; raise the temperature or drop best_of"
            )

    def _check_beam_search(self) -> None:
        """What beam search cannot honour is refused rather than ignored."""
        refused = {
            "best_of": self.best_of not in (None, self.n),
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "stop": bool(self.stop),
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "structured_outputs": self.structured_outputs is not None,
            # A beam search ranks the model's own logprobs: these rules would not reach it.
            "min_tokens": self.min_tokens != 0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
        }
        for name, set_ in refused.items():
            if set_:
                raise ValueError(
                    f"{name} is not supported with use_beam_search (the beam width is n, "
                    f"{self.n}); drop {name} or use_beam_search"
                )

    def _check_token_rules(self) -> None:
        set_field = object.__setattr__
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens ({self.max_tokens})], "
                f"got {self.min_tokens!r}"
            )
        if self.min_tokens and self.structured_outputs is not None:
            # The grammar decides where the output ends; forbidding EOS before min_tokens could
            # leave it no token to allow.
            raise ValueError(
                "min_tokens cannot be combined with structured outputs (the grammar decides "
                "where the output ends); drop min_tokens"
            )
        if self.logit_bias is not None:
            set_field(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, Iterable) or isinstance(ids, str | bytes):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {ids!r}")
            ids = tuple(ids)
            if not ids or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of token ids >= 0, "
                    f"got {self.allowed_token_ids!r}"
                )
            set_field(self, "allowed_token_ids", ids)
        words = self.bad_words
        items = (words,) if isinstance(words, str) else words
        if not isinstance(items, Iterable) or not all(isinstance(w, str) and w for w in items):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
        set_field(self, "bad_words", tuple(items))
        try:
            token_words = tuple(tuple(word) for word in self.bad_words_token_ids)
        except TypeError:
            token_words = None
        if token_words is None or not all(
            word and all(_is_int(t) and 0 <= t <= INT64_MAX for t in word) for word in token_words
        ):
            raise ValueError(
                "bad_words_token_ids must be a list of non-empty lists of token ids >= 0, "
                f"got {self.bad_words_token_ids!r}"
            )
        set_field(self, "bad_words_token_ids", token_words)

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError (naming the field) for a token id of logit_bias, allowed_token_ids or
        bad_words_token_ids outside the model's vocabulary [0, vocab_size)."""
        fields = (
            ("logit_bias", [t for t, _ in self.logit_bias or ()]),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for word in self.bad_words_token_ids for t in word]),
        )
        for name, ids in fields:
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(
                    f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                    f"{sorted(set(outside))[:10]}"
                )

    @property
    def has_token_rules(self) -> bool:
        """True when the sampler must apply min_tokens, logit_bias, allowed_token_ids or
        bad words to this request's logits."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
        )

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates for the request: best_of, else n (beam search: the
        n beams it returns)."""
        return self.best_of or self.n

    @property
    def needs_history(self) -> tuple[bool, bool]:
        """(needs the prompt's ids, needs the output's ids): what the penalties read, and the
        bad words of more than one token (their last token is banned after the rest)."""
        repetition = self.repetition_penalty != 1.0
        return repetition, (
            repetition
            or bool(self.presence_penalty or self.frequency_penalty)
            or any(len(word) > 1 for word in self.bad_words_token_ids)
        )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0, or below GREEDY_TEMPERATURE, or
        top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied; the copy is validated like a new instance."""
        return dataclasses.replace(self, **changes)
