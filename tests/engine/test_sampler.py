"""Sampler: exact masks, penalties, seeds and logprobs on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.engine.worker import sampler as sampler_module
from pagedserve.engine.worker.sampler import Sampler, SamplingRow, _filtered_probs
from pagedserve.scheduler import SamplingParams


def _row(num_output_tokens: int = 0, prompt=None, output=None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), num_output_tokens, prompt, output)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [_row(temperature=0), _row(top_k=1)])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


@pytest.fixture(params=[True, False], ids=["compiled", "torch"])
def compiled(request, monkeypatch) -> bool:
    """Both roads of the sampler on CPU: the compiled picks where the kernels load
    (`sampler._compiled_greedy`, `_compiled_temperature`), or torch's ops with both turned off."""
    if request.param and not sampler_module.cpu_ops.available():
        pytest.skip("no C++ compiler here: the compiled picks do not load, torch's ops sample")
    if not request.param:
        monkeypatch.setattr(sampler_module, "_compiled_greedy", lambda logits, plan: False)
        monkeypatch.setattr(sampler_module, "_compiled_temperature", lambda logits, plan: False)
    return request.param


def test_greedy_rows_with_non_finite_logits_get_token_0(compiled):
    # All-greedy batches take the compiled pick on the compiled road; both roads give the same
    # ids and flags.
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [[0.1, 2.0, 2.0, 1.9], [1.0, nan, 0.0, 3.0], [inf, 0.0, 0.0, 0.0], [0.0, 0.5, -inf, 0.2]]
    )
    out = Sampler()(logits, [_row(temperature=0)] * 4)
    assert out.token_ids == [1, 0, 0, 0]
    assert out.nonfinite_rows == [1, 2, 3]  # -inf too: a model's logits hold none


def test_rows_sampling_by_temperature_alone_follow_their_distribution(compiled, monkeypatch):
    # All-sampling batches with no top-k, top-p, min-p, rule or penalty take the compiled draw on
    # the compiled road; both roads draw the same tokens from the same seeds.
    logits = _logits([0.6, 0.3, 0.1]).repeat(6000, 1)
    rows = [_row(num_output_tokens=i, seed=i, temperature=(1.0, 0.5)[i % 2]) for i in range(6000)]
    plan = Sampler().plan(rows, logits.device)
    assert sampler_module._compiled_temperature(logits, plan) == compiled
    tokens = Sampler()(logits, rows).token_ids
    hot, cold = tokens[0::2], tokens[1::2]
    assert abs(hot.count(0) / 3000 - 0.6) < 0.03 and abs(hot.count(2) / 3000 - 0.1) < 0.02
    z = 0.36 + 0.09 + 0.01  # T = 0.5 squares the probabilities
    assert (
        abs(cold.count(0) / 3000 - 0.36 / z) < 0.03 and abs(cold.count(2) / 3000 - 0.01 / z) < 0.01
    )
    # The same seeds draw the same tokens on the other road (no row's uniform lies within 3e-5 of
    # a boundary between two tokens, far past what rounding moves).
    monkeypatch.setattr(sampler_module, "_compiled_temperature", lambda logits, plan: False)
    assert Sampler()(logits, rows).token_ids == tokens
    # Non-finite rows get token 0 and are reported.
    bad = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    out = Sampler()(bad, [_row(seed=1), _row(seed=2)])
    assert out.token_ids[0] == 0 and out.nonfinite_rows == [0]


def test_top_k_top_p_min_p_masks_are_exact():
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    cases = [
        (SamplingParams(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_p=0.5), [1.0, 0.0, 0.0, 0.0]),  # token 0 alone reaches 0.5
        (SamplingParams(top_p=0.6), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        (SamplingParams(top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.05 < 0.1
        (SamplingParams(top_k=3, top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ]
    for params, expected in cases:
        probs = _filtered_probs(logits.clone(), [params])[0]
        assert probs.tolist() == pytest.approx(expected, abs=1e-6), params


def test_temperature_sharpens_and_flattens():
    logits = _logits([0.6, 0.4])
    hot = _filtered_probs(logits.clone(), [SamplingParams(temperature=2.0)])[0]
    cold = _filtered_probs(logits.clone(), [SamplingParams(temperature=0.5)])[0]
    z_hot = math.sqrt(0.6) + math.sqrt(0.4)
    assert hot.tolist() == pytest.approx([math.sqrt(0.6) / z_hot, math.sqrt(0.4) / z_hot], abs=1e-6)
    assert cold.tolist() == pytest.approx([0.36 / 0.52, 0.16 / 0.52], abs=1e-6)


def test_sampling_follows_the_distribution_and_respects_masks():
    logits = _logits([0.7, 0.2, 0.1]).repeat(4000, 1)
    rows = [_row(num_output_tokens=i, seed=i, top_k=2) for i in range(4000)]
    tokens = Sampler()(logits, rows).token_ids
    assert 2 not in tokens  # masked by top_k
    share = tokens.count(0) / len(tokens)
    assert abs(share - 0.7 / 0.9) < 0.03


def test_seed_gives_the_same_token_whatever_the_batch():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    row = _row(num_output_tokens=5, seed=1234)
    alone = Sampler(seed=1)(logits, [row]).token_ids[0]
    others = torch.randn(6, 1000)
    batch = torch.cat([others[:3], logits, others[3:]])
    rows = [_row(num_output_tokens=0, temperature=1.0)] * 3 + [row] + [_row()] * 3
    assert Sampler(seed=99)(batch, rows).token_ids[3] == alone
    # The position enters the seed: another position draws independently.
    draws = {
        Sampler()(logits, [_row(num_output_tokens=k, seed=1234)]).token_ids[0] for k in range(20)
    }
    assert len(draws) > 1


def test_repetition_penalty_is_exact():
    sampler = Sampler()
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    row = _row(prompt=[0], output=[1], repetition_penalty=2.0)
    out = sampler._apply_penalties(logits.clone(), [row])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_frequency_and_presence_penalties_are_exact():
    sampler = Sampler()
    logits = torch.zeros(1, 4)
    row = _row(output=[2, 2, 1], frequency_penalty=0.5, presence_penalty=0.25)
    out = sampler._apply_penalties(logits, [row])
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0]]


def test_logprobs_of_chosen_and_top_k():
    logits = _logits([0.5, 0.25, 0.125, 0.125])
    out = Sampler()(logits, [_row(temperature=0, logprobs=2)])
    chosen_lp, rank, top = out.logprobs[0]
    assert out.token_ids == [0]
    assert chosen_lp == pytest.approx(math.log(0.5))
    assert rank == 1
    assert [t for t, _ in top] == [0, 1]
    assert [lp for _, lp in top] == pytest.approx([math.log(0.5), math.log(0.25)])


def test_logprobs_describe_the_unpenalised_distribution():
    logits = _logits([0.5, 0.5])
    out = Sampler()(logits, [_row(output=[0], temperature=0, frequency_penalty=2.0, logprobs=0)])
    chosen_lp, rank, top = out.logprobs[0]
    assert out.token_ids == [1]  # the penalty moved the choice ...
    assert chosen_lp == pytest.approx(math.log(0.5))  # ... but logprobs are the model's own
    assert top == []


def test_token_logprobs_score_given_tokens_with_per_row_k():
    from pagedserve.engine.worker.sampler import token_logprobs

    # Row 0 scores a mid-ranked token with k = 2; row 1 its top token with k = 0. Shifted logits
    # (not log-probabilities) check that the values are normalised.
    logits = torch.cat([_logits([0.5, 0.25, 0.125, 0.125]), _logits([0.1, 0.2, 0.3, 0.4]) + 3.0])
    out = token_logprobs(logits, torch.tensor([2, 3]), [2, 0])
    (lp0, rank0, top0), (lp1, rank1, top1) = out
    assert (rank0, rank1) == (3, 1)
    assert [lp0, lp1] == pytest.approx([math.log(0.125), math.log(0.4)])
    assert [t for t, _ in top0] == [0, 1]
    assert [lp for _, lp in top0] == pytest.approx([math.log(0.5), math.log(0.25)])
    assert top1 == []
    with pytest.raises(ValueError, match="2 rows of logits for 1 token ids and 2 ks"):
        token_logprobs(logits, torch.tensor([0]), [1, 1])


def test_inverse_cdf_sample_picks_exact_tokens():
    from pagedserve.engine.worker.sampler import inverse_cdf_sample

    # 10 tokens in chunks of 4 (the last chunk padded): masses 0.375 | 0.0 | 0.625 (all exact
    # in binary, so the boundaries are exact too).
    probs = torch.tensor([[0.125, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.625]])
    cases = {0.0: 0, 0.1: 0, 0.125: 2, 0.374: 2, 0.375: 9, 0.99: 9, 0.999999: 9}
    for u, expected in cases.items():
        got = inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64), chunk=4)
        assert got.tolist() == [expected], u
    # Unnormalised rows work the same (u scales the total mass).
    got = inverse_cdf_sample(probs * 4, torch.tensor([0.25], dtype=torch.float64), chunk=4)
    assert got.tolist() == [2]


def test_penalties_of_several_rows_are_applied_per_row():
    # Three rows with different penalties in one batch: each row gets exactly its own.
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [
        _row(prompt=[0, 0], output=[1], repetition_penalty=2.0),
        _row(output=[2, 2, 1], frequency_penalty=0.5, presence_penalty=0.25),
        _row(),  # no penalty
    ]
    before = logits.clone()
    out = Sampler()._apply_penalties(logits, rows)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [0.0, -0.75, -1.25, 0.0], [1.0] * 4]
    assert torch.equal(logits, before)  # the caller's logits still give unpenalised logprobs


def test_mixed_greedy_and_random_rows():
    # Row 0 greedy, rows 1-2 sampled with seeds (top_k=1 is greedy too): the greedy rows take the
    # argmax, the seeded row draws what it draws alone.
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.5, 0.2, 0.3], [1.0, 9.0, 2.0]]).log_softmax(-1)
    rows = [_row(temperature=0), _row(seed=7, num_output_tokens=3), _row(top_k=1, logprobs=1)]
    out = Sampler(seed=3)(logits, rows)
    alone = Sampler(seed=11)(logits[1:2], [rows[1]]).token_ids[0]
    assert out.token_ids == [1, alone, 1]
    assert out.logprobs[:2] == [None, None]
    chosen_lp, rank, top = out.logprobs[2]
    assert rank == 1 and top[0][0] == 1 and chosen_lp == pytest.approx(top[0][1])


def test_to_device_keeps_cpu_tensors_and_builds_lists():
    from pagedserve.engine.worker.sampler import to_device

    t = torch.arange(3)
    assert to_device(t, torch.long, torch.device("cpu")) is t
    built = to_device([1.5, 2.5], torch.float64, torch.device("cpu"))
    assert built.dtype == torch.float64 and built.tolist() == [1.5, 2.5]


def test_seeded_uniform_is_uniform_and_reproducible():
    from pagedserve.engine.worker.sampler import seeded_uniform

    draws = [seeded_uniform(1234, k) for k in range(20_000)]
    assert draws == [seeded_uniform(1234, k) for k in range(20_000)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    # Ten equal buckets each get 10% +- 0.6% (about 3 standard deviations).
    counts = [0] * 10
    for u in draws:
        counts[int(u * 10)] += 1
    assert all(abs(c - 2000) < 120 for c in counts), counts
    # Neighbouring seeds at one position are independent streams too.
    assert abs(sum(seeded_uniform(s, 0) for s in range(20_000)) / 20_000 - 0.5) < 0.01
    assert seeded_uniform(-7, 3) != seeded_uniform(7, 3)
