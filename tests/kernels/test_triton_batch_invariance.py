"""One request, one answer on the Triton path: by default (`cpu_features.batch_variant` off) the
paged attention of a query is a function of its own q, position and keys, bit for bit, whatever
else shares the step: a decode alone or among 1, 7 or 16 other sequences, the same position as
the last token of a prefill chunk, its prompt in one chunk or in chunks of 1, 5 or 16 tokens,
decodes mixed with prefills and extends (`triton_attention.invariant_config`).

Under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), as tests/kernels/test_triton.py;
on a GPU, `bash benchmarks/gpu_kernels.sh` with ONLY=invariance checks the compiled kernels. The
interpreter computes a bfloat16 tl.dot on raw bit patterns (triton-lang/triton#11584): its
bfloat16 outputs are wrong, but the same wrong bits must come out of every batch, which is what
is checked here; float16 and float32 are also right (tests/kernels/test_triton.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.kernels import cpu_features, triton_attention
from tests.helpers import record_calls
from tests.kernels.paged_batch import Stream, random_stream, step_of

pytestmark = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `ONLY=invariance bash benchmarks/gpu_kernels.sh` checks the "
    "compiled kernels",
)

SCALE = 0.125
TARGET_LEN = 130  # three 64-key tiles, the last one partly filled
# (dtype, (num_heads, num_kv_heads), options): GQA 4 (4 tokens per 16-row query tile) and 3 (5
# tokens and a padding row; two KV heads), a sliding window with soft-capping; float16 and
# bfloat16 once. Few KV heads: each is a program of its own, and the interpreter is slow.
CASES = [
    (torch.float32, (4, 1), {}),
    (torch.float32, (6, 2), {}),
    (torch.float32, (4, 1), {"sliding_window": 40, "softcap": 2.0}),
    (torch.float16, (4, 1), {}),
    (torch.bfloat16, (4, 1), {}),
]


def random_seq(length: int, heads: tuple[int, int], dtype: torch.dtype, seed: int) -> Stream:
    return random_stream(length, *heads, 64, dtype, seed)


def attend(spans: list[tuple[Stream, int, int]], seed: int = 0, **kwargs) -> list[torch.Tensor]:
    """One step of the spans' positions (`step_of`); each span's rows of the output."""
    b = step_of(spans, block_size=16, seed=seed)
    out = triton_attention.paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, SCALE, **kwargs
    )
    return list(out.split(b.q_lens))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: -0.0 is not 0.0."""
    integer = torch.int32 if a.element_size() == 4 else torch.int16
    return torch.equal(a.view(integer), b.view(integer))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert same_bits(got, want), f"{what}: not bit for bit the same"


def others(n: int, heads, dtype, seed: int) -> list[Stream]:
    rng = random.Random(seed)
    return [random_seq(rng.randrange(1, 200), heads, dtype, seed + i) for i in range(1, n + 1)]


@pytest.mark.parametrize(("dtype", "heads", "kwargs"), CASES)
def test_a_query_is_the_same_in_every_batch(dtype, heads, kwargs):
    target = random_seq(TARGET_LEN, heads, dtype, seed=0)
    last = TARGET_LEN - 1
    # Every position of the prompt in one chunk, alone.
    (want,) = attend([(target, 0, TARGET_LEN)], **kwargs)
    assert want.isfinite().all()

    # The prompt in chunks: each chunk a step on the chunks before it (1: decode steps, the last
    # 12 positions only, to keep the interpreter's time down).
    for chunk, begin in ((1, TARGET_LEN - 12), (5, 0), (16, 0)):
        got = [want[:begin]]
        for start in range(begin, TARGET_LEN, chunk):
            end = min(start + chunk, TARGET_LEN)
            got += attend([(target, start, end)], seed=start, **kwargs)
        assert_same_bits(torch.cat(got), want, f"chunks of {chunk}")

    # The last position as a decode among 1, 7 and 16 other decodes of other lengths: first and
    # last among 1 and 7, in the middle of 16.
    for n, places in ((1, (0, 1)), (7, (0, 7)), (16, (8,))):
        decodes = [(seq, len(seq.q) - 1, len(seq.q)) for seq in others(n, heads, dtype, seed=n)]
        for at in places:
            spans = decodes[:at] + [(target, last, TARGET_LEN)] + decodes[at:]
            got = attend(spans, seed=n + at, **kwargs)[at]
            assert_same_bits(got, want[last:], f"a decode at {at} among {n}")

    # Mixed steps: the target as a decode among prefills, extends and decodes; then its last 16
    # positions as an extend chunk beside them.
    a, b, c, d = (random_seq(n, heads, dtype, seed=100 + n) for n in (30, 90, 60, 170))
    mixed = [(a, 0, 30), (b, 89, 90), (c, 40, 60)]  # a prefill, a decode, an extend
    got = attend([*mixed, (target, last, TARGET_LEN), (d, 169, 170)], **kwargs)
    assert_same_bits(got[3], want[last:], "a decode in a mixed step")
    got = attend([mixed[1], (target, TARGET_LEN - 16, TARGET_LEN), *mixed[::2]], **kwargs)
    assert_same_bits(got[1], want[-16:], "an extend chunk in a mixed step")


def test_the_default_is_one_kernel_and_the_batch_variant_path_opts_in(monkeypatch):
    """By default decodes and prefills meet the same kernel in the same configuration; with
    PAGEDSERVE_BATCH_VARIANT=1 a decode step runs the split-context decode kernel."""
    launches = record_calls(monkeypatch, triton_attention, ("decode", "extend"))
    target = random_seq(20, (4, 2), torch.float32, seed=1)
    monkeypatch.delenv(cpu_features.BATCH_VARIANT_ENV, raising=False)
    cpu_features.batch_variant.cache_clear()
    try:
        attend([(target, 19, 20)])
        attend([(target, 0, 20)])
        assert launches == ["extend", "extend"]
        monkeypatch.setenv(cpu_features.BATCH_VARIANT_ENV, "1")
        cpu_features.batch_variant.cache_clear()
        attend([(target, 19, 20)])
        attend([(target, 0, 20)])
        assert launches[2:] == ["decode", "extend"]
    finally:
        monkeypatch.undo()
        cpu_features.batch_variant.cache_clear()
    # One configuration per head layout: the batch never enters it.
    config = triton_attention.invariant_config(64, 4)
    assert (config.block_m, config.tile, config.mask_every_tile) == (16, 64, True)
    assert triton_attention.invariant_config(128, 32).block_m == 32


# Not bfloat16: the interpreter's bfloat16 scores are so large that every softmax is one-hot.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_with_batch_variant_the_answer_depends_on_the_batch(dtype, batch_variant):
    """PAGEDSERVE_BATCH_VARIANT=1: the old dispatch. The same query differs as a decode (the
    decode kernel: 128-key tiles here, the context in 2 slices when the batch leaves the 4 "SMs"
    the interpreter assumes idle) and as the last token of a prefill (the extend kernel), and as
    a decode alone (2 slices) and among 16 others (1): the checks above can fail, and would if
    the default went back to it."""
    heads = (4, 2)
    target = random_seq(600, heads, dtype, seed=2)  # 600 keys: 256+ per split
    (prefill,) = attend([(target, 0, 600)])
    (alone,) = attend([(target, 599, 600)])
    decodes = [(seq, len(seq.q) - 1, len(seq.q)) for seq in others(16, heads, dtype, seed=3)]
    among = attend([(target, 599, 600), *decodes])[0]
    max_context = 39 * 16  # step_of's block table alone: 38 blocks of 16 + 1
    assert triton_attention.num_decode_splits(1, 2, max_context, alone.device) == 2
    assert triton_attention.num_decode_splits(17, 2, max_context, alone.device) == 1
    assert not same_bits(alone, prefill[-1:])
    assert not same_bits(alone, among)
