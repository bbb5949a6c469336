"""`pagedserve bench quality`'s measures (bench/quality.py) on hand-made logprobs: the top-1 of
the reference is its lowest id among ties, as greedy decoding takes it, and the three figures
come out as their definitions say. The prose it reads ships with Python."""

from __future__ import annotations

import math

import torch

from pagedserve.bench import quality


class _Letters:
    """A tokenizer of one letter per id (a = 0, b = 1, ...)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 26 for c in text]


def test_compare_scores_top1_logprob_deltas_and_perplexity():
    window = [0, 1, 2, 1]  # predicts b, c, b
    ref = torch.log_softmax(torch.tensor([[0.0, 2.0, 2.0], [1.0, 0.0, 3.0], [5.0, 0.0, 0.0]]), -1)
    expected = [ref[0, 1].item(), ref[1, 2].item(), ref[2, 1].item()]
    # The server: b (the reference's lowest id of the tie b/c), then a (not c), then a.
    served = [("b", expected[0]), ("a", expected[1] - 0.5), ("a", expected[2] + 0.25)]
    got = quality.compare(_Letters(), [window], [ref], [served])
    assert got["positions"] == 3
    assert got["teacher_forced_top1_agreement"] == round(2 / 3, 5)
    assert got["mean_abs_delta_logprob"] == round(0.75 / 3, 5)
    assert got["perplexity_ratio"] == round(math.exp(0.25 / 3), 5)


def test_prose_windows_cut_the_python_reference_into_whole_windows():
    from pydoc_data.topics import topics

    windows = quality.prose_windows(_Letters(), positions=100, window=51)
    assert [len(w) for w in windows] == [51, 51]  # 50 predictions each
    first = topics[sorted(topics)[0]]
    assert (
        windows[0] == _Letters().encode(first[:51])
        and windows[1][0] == _Letters().encode(first[51])[0]
    )
