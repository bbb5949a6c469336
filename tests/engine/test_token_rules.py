"""vLLM's token rules (logit_bias, min_tokens, bad_words, allowed_token_ids): their checks, their
exact effect on a batch's logits, and the engine honouring them on every sampling path (greedy and
seeded sampling, n > 1, n-gram drafts, asynchronous scheduling), against transformers' own
logits processors on the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.frontend.inputs import bad_words_token_ids
from pagedserve.engine.worker.sampler import Sampler, SamplingRow
from pagedserve.engine.worker.token_rules import TokenRules
from tests.helpers import finish_all

NEG = float("-inf")


# ---- the params' checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias values must be numbers in [-100, 100], got 100.5"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to biases"),
        ({"min_tokens": 17}, "min_tokens must be an int in [0, max_tokens (16)], got 17"),
        ({"min_tokens": -1}, "min_tokens must be an int in [0, max_tokens (16)], got -1"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids must be a non-empty list of token"),
        ({"bad_words": ["ok", ""]}, "bad_words must be a list of non-empty strings"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be a list of non-empty lists"),
        (
            {"min_tokens": 2, "structured_outputs": {"regex": "a+"}},
            "min_tokens cannot be combined with structured outputs",
        ),
        (
            {"use_beam_search": True, "n": 2, "temperature": 0, "logit_bias": {1: 1}},
            "logit_bias is not supported with use_beam_search",
        ),
        (
            {"use_beam_search": True, "n": 2, "temperature": 0, "bad_words": ["x"]},
            "bad_words is not supported with use_beam_search",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, message):
    from pagedserve.scheduler import StructuredOutputs

    if "structured_outputs" in fields:
        fields = {**fields, "structured_outputs": StructuredOutputs(**fields["structured_outputs"])}
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert str(e.value).startswith(message)


def test_values_are_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={7: 1, 3: -100}, allowed_token_ids=[4, 9], bad_words="no")
    assert p.logit_bias == ((3, -100.0), (7, 1.0))
    assert (p.allowed_token_ids, p.bad_words) == ((4, 9), ("no",))
    assert hash(p) == hash(p.clone())
    p.check_token_ids(10)
    with pytest.raises(ValueError, match=r"allowed_token_ids has token ids outside the vocabu"):
        p.check_token_ids(9)
    with pytest.raises(ValueError, match=r"logit_bias has token ids .* \[0, 5\): \[7\]"):
        SamplingParams(logit_bias={7: 1}).check_token_ids(5)
    # Only a bad word of several tokens reads the output history.
    assert SamplingParams(bad_words_token_ids=[[5]]).needs_history == (False, False)
    assert SamplingParams(bad_words_token_ids=[[5], [6, 7]]).needs_history == (False, True)


# ---- the rules on a batch's logits -------------------------------------------------------------


def _row(params: SamplingParams, num_output_tokens: int = 0, output=None) -> SamplingRow:
    return SamplingRow(params, num_output_tokens, None, output)


def test_each_rule_changes_exactly_its_tokens():
    rows = [
        _row(SamplingParams(logit_bias={1: 2.5, 4: -100})),
        _row(SamplingParams(allowed_token_ids=[0, 3])),
        # min_tokens: EOS (5) and the stop ids are banned before 2 output tokens, not after.
        _row(SamplingParams(min_tokens=2, stop_token_ids=[2]), num_output_tokens=1),
        _row(SamplingParams(min_tokens=2, stop_token_ids=[2]), num_output_tokens=2),
        _row(SamplingParams(min_tokens=2, ignore_eos=True), num_output_tokens=0),
        # A one-token word always; [3, 4] bans 4 after a 3 only; [0, 1, 2] needs 0, 1 at the end.
        _row(SamplingParams(bad_words_token_ids=[[6], [3, 4], [0, 1, 2]]), 3, [3, 0, 1]),
        _row(SamplingParams(bad_words_token_ids=[[6], [3, 4], [0, 1, 2]]), 2, [1, 3]),
        _row(SamplingParams()),
    ]
    rules = TokenRules.plan(rows, frozenset({5}), torch.device("cpu"))
    logits = torch.arange(7, dtype=torch.float32).repeat(len(rows), 1)
    rules.apply(logits)
    expected = [
        [0, 3.5, 2, 3, -96, 5, 6],
        [0, NEG, NEG, 3, NEG, NEG, NEG],
        [0, 1, NEG, 3, 4, NEG, 6],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, NEG, 3, 4, 5, NEG],
        [0, 1, 2, 3, NEG, 5, NEG],
        [0, 1, 2, 3, 4, 5, 6],
    ]
    assert logits.tolist() == expected
    assert TokenRules.plan([_row(SamplingParams())], frozenset({5}), torch.device("cpu")) is None


def test_the_sampler_applies_rules_before_temperature_and_keeps_raw_logprobs():
    sampler = Sampler(seed=0)
    sampler.eos_token_ids = frozenset({0})
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = [
        _row(SamplingParams(temperature=0, logit_bias={1: 100}, logprobs=1)),
        # Temperature divides the biased logits: 1 + 3 = 4 against 3 -> softmax of (4, 3) / 0.5.
        _row(SamplingParams(temperature=0.5, logit_bias={1: 3}, allowed_token_ids=[1, 3])),
        # Nothing left (its only allowed token is EOS, banned before min_tokens): the row fails.
        _row(SamplingParams(allowed_token_ids=[0], min_tokens=1)),
    ]
    plan = sampler.plan(rows, logits.device)
    out = sampler.sample(logits.clone(), plan).to_host()
    assert out.token_ids[0] == 1 and out.token_ids[2] == 0
    assert out.nonfinite_rows == [2]
    # The logprob reported is the model's own (before the bias), as vLLM's raw_logprobs.
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0][0] == pytest.approx(raw[1].item())
    assert out.logprobs[0][1] == 3  # its rank among the raw logits
    # Row 1 draws token 1 with probability softmax([4, 3] / 0.5)[0] = 1 / (1 + e^-2).
    p1 = 1 / (1 + torch.exp(torch.tensor(-2.0)).item())
    draws = [sampler.sample(logits.clone(), sampler.plan(rows, logits.device)) for _ in range(400)]
    share = sum(d.to_host().token_ids[1] == 1 for d in draws) / len(draws)
    assert abs(share - p1) < 0.06


def test_bad_words_are_tokenized_with_and_without_a_leading_space(real_llm):
    tokenizer = real_llm.get_tokenizer()
    bare = tokenizer.encode("Paris", add_special_tokens=False)
    spaced = tokenizer.encode(" Paris", add_special_tokens=False)
    assert bare != spaced and len(bare) == len(spaced) == 1
    assert bad_words_token_ids(tokenizer, ["Paris", "  Paris"]) == (
        (*bare,), (*spaced,), (*bare,), (*spaced,),
    )  # fmt: skip


# ---- the engine on the tiny random Llama: every sampling path ----------------------------------

PROMPTS = [[10, 11, 12, 13, 14] * 4, [30, 31, 32] * 6 + [30], [50 + i % 7 for i in range(25)]]


def _engine(model_dir, **changes) -> LLMEngine:
    config = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4)
    return LLMEngine(EngineConfig(max_model_len=128, num_kv_blocks=96, **{**config, **changes}))


def _generate(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    done = finish_all(
        engine, {str(i): pair for i, pair in enumerate(zip(prompts, params, strict=True))}
    )
    return [[c.token_ids for c in done[str(i)].outputs] for i in range(len(prompts))]


def test_rules_hold_on_every_sampling_path(tiny_llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = _engine(tiny_llama_dir)
    base = [outs[0] for outs in _generate(plain, PROMPTS, [greedy] * 3)]
    first, stop_at = base[0][0], base[1][3]
    run = base[2][:2]  # a two-token word the greedy output holds
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=24, n=2)
    cases = [
        greedy.clone(logit_bias={first: -100}),
        greedy.clone(logit_bias={7: 100}),
        greedy.clone(stop_token_ids=[stop_at], min_tokens=10, ignore_eos=True),
        greedy.clone(bad_words_token_ids=[run]),
        sampled.clone(allowed_token_ids=[40, 41, 42], logit_bias={42: 1.5}),
        sampled.clone(bad_words_token_ids=[[run[1]]], logit_bias={first: -100}),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[2]]
    expected = _generate(plain, prompts, cases)
    (banned,), (forced,), (late_stop,), (no_run,), allowed, no_token = expected
    assert first not in banned and banned != base[0]
    assert forced == [7] * 24
    # The stop token cannot end it before 10 tokens; the greedy path reaches it at index 3.
    assert late_stop[:3] == base[1][:3] and stop_at not in late_stop[:10]
    assert all(no_run[i : i + 2] != run for i in range(len(no_run) - 1)) and no_run != base[2]
    assert all(set(s) <= {40, 41, 42} for s in allowed) and allowed[0] != allowed[1]
    assert all(run[1] not in s and first not in s for s in no_token)
    # The same tokens with n-gram drafts (a bad word of several tokens reads the history: that
    # request gets none) and with asynchronous scheduling.
    spec = _engine(tiny_llama_dir, speculative_ngram=4)
    assert _generate(spec, prompts, cases) == expected
    assert spec.stats().spec_accepted_tokens > 0
    assert _generate(_engine(tiny_llama_dir, async_scheduling=True), prompts, cases) == expected


# ---- the real model against transformers -------------------------------------------------------


def test_greedy_rules_match_transformers(real_llm, hf_smollm2):
    """transformers' sequence_bias, bad_words_ids and min_new_tokens are the same rules."""
    model, tok = hf_smollm2
    chat = "<|im_start|>user\nWhat is 2+2? Reply with just the number.<|im_end|>\n"
    chat += "<|im_start|>assistant\n"
    ids = tok(chat, return_tensors="pt").input_ids
    plain = real_llm.generate([chat], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) == 8  # "2 + 2 = 4", EOS
    eos = plain.token_ids[-1]
    words = [plain.token_ids[2:4]]  # a two-token stretch of the plain answer
    bias = {plain.token_ids[1]: -4.0, plain.token_ids[6]: 2.5}
    params = SamplingParams(
        temperature=0, max_tokens=12, min_tokens=10, logit_bias=bias, bad_words_token_ids=words
    )
    ours = real_llm.generate([chat], params)[0].outputs[0].token_ids
    with torch.no_grad():
        theirs = model.generate(
            ids, do_sample=False, max_new_tokens=12, min_new_tokens=10, eos_token_id=eos,
            sequence_bias={(t,): b for t, b in bias.items()}, bad_words_ids=words,
            pad_token_id=eos,
        )[0, ids.shape[1]:].tolist()  # fmt: skip
    assert ours == theirs[: len(ours)] and len(ours) >= 10
    assert ours[:8] != plain.token_ids
    assert eos not in ours[:10]


def test_allowed_token_ids_and_a_grammar_combine(real_llm):
    """Both masks apply: the choice the grammar allows that allowed_token_ids leaves; none left
    fails the request with an error saying so."""
    from pagedserve.scheduler import StructuredOutputs

    tok = real_llm.get_tokenizer()
    prompt = "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    choice = StructuredOutputs(choice=("yes", "no"))
    greedy = SamplingParams(temperature=0, max_tokens=4, structured_outputs=choice)
    (plain,) = real_llm.generate([prompt], greedy)
    other = {"yes": "no", "no": "yes"}[plain.outputs[0].text]
    allowed = [*tok.encode(other, add_special_tokens=False), tok.eos_token_id]
    (limited,) = real_llm.generate([prompt], greedy.clone(allowed_token_ids=allowed))
    assert limited.outputs[0].text == other
    (none_left,) = real_llm.generate(
        [prompt], greedy.clone(allowed_token_ids=tok.encode(" Paris", add_special_tokens=False))
    )
    assert none_left.outputs[0].finish_reason == "error"
    assert none_left.error.startswith("no token could be sampled: allowed_token_ids, bad_words")


def test_stop_strings_wait_for_min_tokens(real_llm):
    """A stop string the first min_tokens tokens complete is passed over for good; one completed
    later still ends the output."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    (plain,) = real_llm.generate(["The capital of France is"], greedy)
    assert plain.outputs[0].text.startswith(" Paris.\n\nThe answer")
    (early,) = real_llm.generate(["The capital of France is"], greedy.clone(stop=[" Paris"]))
    assert early.outputs[0].text == ""
    late_params = greedy.clone(stop=[" Paris", "answer"], min_tokens=3)
    (late,) = real_llm.generate(["The capital of France is"], late_params)
    assert (late.outputs[0].text, late.outputs[0].stop_reason) == (" Paris.\n\nThe ", "answer")
