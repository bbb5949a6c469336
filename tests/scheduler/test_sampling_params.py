from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pagedserve.scheduler import SamplingParams


def test_defaults() -> None:
    params = SamplingParams()
    assert dataclasses.astuple(params) == (
        1,  # n
        None,  # best_of (= n)
        1.0,  # temperature
        1.0,  # top_p
        -1,  # top_k
        0.0,  # min_p
        16,  # max_tokens
        (),  # stop
        (),  # stop_token_ids
        False,  # ignore_eos
        None,  # seed
        0.0,  # presence_penalty
        0.0,  # frequency_penalty
        1.0,  # repetition_penalty
        None,  # logprobs
        None,  # prompt_logprobs
        True,  # skip_special_tokens
        False,  # include_stop_str_in_output
        False,  # use_beam_search
        1.0,  # length_penalty
        None,  # structured_outputs
        "cumulative",  # output_kind
        0,  # min_tokens
        None,  # logit_bias
        None,  # allowed_token_ids
        (),  # bad_words
        (),  # bad_words_token_ids
    )
    assert not params.greedy and params.num_samples == 1


SEED_RANGE = (
    "seed must be None or an int in [-9223372036854775808, 9223372036854775807] (signed 64 bits), "
)


@pytest.mark.parametrize(
    ("field", "value", "expected_message"),
    [
        ("n", 0, "n must be an int >= 1, got 0"),
        ("n", True, "n must be an int >= 1, got True"),
        ("n", 1.0, "n must be an int >= 1, got 1.0"),
        ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
        ("temperature", math.nan, "temperature must be >= 0, got nan"),
        ("temperature", math.inf, "temperature must be >= 0, got inf"),
        ("temperature", "0.5", "temperature must be a number >= 0, got '0.5'"),
        ("temperature", False, "temperature must be a number >= 0, got False"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_p", -0.1, "top_p must be in (0, 1], got -0.1"),
        ("top_k", -2, "top_k must be -1 or 0 (off) or an int in [1, 9223372036854775807], got -2"),
        (
            "top_k",
            2.0,
            "top_k must be -1 or 0 (off) or an int in [1, 9223372036854775807], got 2.0",
        ),
        (
            "top_k",
            True,
            "top_k must be -1 or 0 (off) or an int in [1, 9223372036854775807], got True",
        ),
        ("min_p", -0.5, "min_p must be in [0, 1], got -0.5"),
        ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
        (
            "top_k",
            2**63,
            f"top_k must be -1 or 0 (off) or an int in [1, {2**63 - 1}], got {2**63}",
        ),
        (
            "max_tokens",
            2**63,
            "max_tokens must be an int in [1, 9223372036854775807], got 9223372036854775808",
        ),
        ("max_tokens", 0, "max_tokens must be an int in [1, 9223372036854775807], got 0"),
        ("max_tokens", 16.0, "max_tokens must be an int in [1, 9223372036854775807], got 16.0"),
        ("max_tokens", None, "max_tokens must be an int in [1, 9223372036854775807], got None"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2], got -2.01"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
        ("frequency_penalty", 2.0001, "frequency_penalty must be in [-2, 2], got 2.0001"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
        ("repetition_penalty", -1.0, "repetition_penalty must be > 0, got -1.0"),
        ("logprobs", -1, "logprobs must be None or an int in [0, 20], got -1"),
        ("logprobs", 21, "logprobs must be None or an int in [0, 20], got 21"),
        ("logprobs", True, "logprobs must be None or an int in [0, 20], got True"),
        ("prompt_logprobs", -1, "prompt_logprobs must be None or an int in [0, 20], got -1"),
        ("prompt_logprobs", 21, "prompt_logprobs must be None or an int in [0, 20], got 21"),
        ("prompt_logprobs", 2.0, "prompt_logprobs must be None or an int in [0, 20], got 2.0"),
        ("stop", "", "stop must contain only non-empty strings, got ''"),
        ("stop", ["ok", ""], "stop must contain only non-empty strings, got ''"),
        ("stop", [1], "stop must contain only non-empty strings, got 1"),
        ("stop", 5, "stop must be a string or a list of strings, got 5"),
        (
            "stop_token_ids",
            [-1],
            "stop_token_ids must contain only ints in [0, 9223372036854775807], got -1",
        ),
        (
            "stop_token_ids",
            [1, False],
            "stop_token_ids must contain only ints in [0, 9223372036854775807], got False",
        ),
        ("stop_token_ids", "12", "stop_token_ids must be a list of token ids >= 0, got '12'"),
        ("seed", 1.5, SEED_RANGE + "got 1.5"),
        ("seed", "7", SEED_RANGE + "got '7'"),
        ("seed", 2**63, SEED_RANGE + "got 9223372036854775808"),
        ("seed", -(2**63) - 1, SEED_RANGE + "got -9223372036854775809"),
        ("ignore_eos", 1, "ignore_eos must be a bool, got 1"),
        ("skip_special_tokens", "yes", "skip_special_tokens must be a bool, got 'yes'"),
        ("include_stop_str_in_output", None, "include_stop_str_in_output must be a bool, got None"),
        (
            "output_kind",
            "stream",
            "output_kind must be one of ['cumulative', 'delta', 'final'], got 'stream'",
        ),
    ],
)
def test_invalid_value_raises_naming_field_and_value(
    field: str, value: Any, expected_message: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert str(excinfo.value) == expected_message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0),
        ("top_p", 1),
        ("top_k", 0),
        ("top_k", 1),
        ("min_p", 1),
        ("presence_penalty", -2),
        ("frequency_penalty", 2),
        ("repetition_penalty", 1e-6),
        ("logprobs", 0),
        ("logprobs", 20),
        ("prompt_logprobs", 0),
        ("prompt_logprobs", 20),
        ("seed", -5),
    ],
)
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_numeric_floats_are_stored_as_float() -> None:
    params = SamplingParams(temperature=0, top_p=1, presence_penalty=-2, repetition_penalty=2)
    assert type(params.temperature) is float
    assert type(params.top_p) is float
    assert type(params.presence_penalty) is float
    assert type(params.repetition_penalty) is float


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("###", ("###",)),
        (["a", "bc"], ("a", "bc")),
        (("x",), ("x",)),
        (None, ()),
        ([], ()),
    ],
)
def test_stop_is_normalised_to_a_tuple(stop: Any, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_are_normalised_to_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 0, 7]).stop_token_ids == (3, 0, 7)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_normalised_params_are_hashable_and_equal() -> None:
    assert SamplingParams(stop=["a"]) == SamplingParams(stop="a")
    assert hash(SamplingParams(stop=["a"], stop_token_ids=[1])) == hash(
        SamplingParams(stop=("a",), stop_token_ids=(1,))
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "greedy"),
    [(0.0, -1, True), (0.7, 1, True), (0.7, -1, False), (1.0, 2, False), (0.0, 5, True)],
)
def test_greedy(temperature: float, top_k: int, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature, top_k=top_k).greedy is greedy


def test_clone_applies_changes_and_validates() -> None:
    base = SamplingParams(temperature=0.5, stop="x")
    clone = base.clone(max_tokens=3, stop=["y"])
    assert (clone.temperature, clone.max_tokens, clone.stop) == (0.5, 3, ("y",))
    assert base.max_tokens == 16
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 2"):
        base.clone(top_p=2)


def test_params_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]


def test_structured_outputs_take_exactly_one_well_formed_constraint() -> None:
    from pagedserve.scheduler import StructuredOutputs

    schema = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    # Kept as compact JSON in the schema's own order (the output lists properties in it).
    assert schema.json == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert schema == StructuredOutputs(json=' { "type" : "object", "properties": {"b":{}, "a":{}}}')
    assert StructuredOutputs(choice="yes").choice == ("yes",)
    assert StructuredOutputs(choice=["a", "b"]).kinds == ["choice"]
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]+"))
    assert hash(params) == hash(
        SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]+"))
    )
    for fields, message in (
        ({}, "exactly one of json, json_object, regex, choice and grammar, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{"}, "the JSON schema is not valid JSON"),
        ({"json": "[1]"}, "a JSON schema must be an object"),
        ({"choice": []}, "choice must be a non-empty list of non-empty strings"),
        ({"choice": ["a", ""]}, "choice must be a non-empty list"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": 3}, "grammar must be a non-empty string"),
        ({"json_object": "yes"}, "json_object must be a bool"),
    ):
        with pytest.raises(ValueError, match=message):
            StructuredOutputs(**fields)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam"):
        SamplingParams(n=2, use_beam_search=True, structured_outputs=StructuredOutputs(regex="a"))
