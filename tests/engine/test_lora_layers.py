"""The LoRA projections as the engine runs them on CPU (engine/lora/layers.py): a step's tokens
take the masked path (few tokens, on weights oneDNN-packed where the CPU allows it) or the
grouped one, and either gives the per-token reference's deltas. Where bf16 weights are packed
depends on the CPU (`cpu_linear.can_pack`: not on AVX2-only CPUs); tests/engine/test_lesser_cpu.py
runs this file at the avx2 level too, so both the packed and the plain masked path are checked
on any AVX512 machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.engine.lora.adapter import LoRAWeights
from pagedserve.engine.lora.layers import DENSE_TOKENS, NO_SLOT, LoRAProjection, LoRAStep
from pagedserve.engine.models.cpu_linear import can_pack, is_packed
from pagedserve.kernels.lora import lora_add_reference

PARTS, IN_FEATURES, MAX_RANK, SLOTS = (48, 16, 16), 40, 16, 3
RANKS = (4, 8, 16)  # slot s holds an adapter of rank RANKS[s]


def _projection(dtype: torch.dtype) -> tuple[LoRAStep, LoRAProjection]:
    step = LoRAStep(256, SLOTS, dtype, torch.device("cpu"))
    projection = LoRAProjection(step, PARTS, IN_FEATURES, SLOTS, MAX_RANK, dtype)
    gen = torch.Generator().manual_seed(0)
    for slot, rank in enumerate(RANKS):
        a = torch.randn(len(PARTS), rank, IN_FEATURES, generator=gen) * 0.2
        b = torch.randn(sum(PARTS), rank, generator=gen) * 0.2
        projection.load(slot, LoRAWeights(a, b))
        step.slot_ranks[slot] = rank
    return step, projection


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [16, 200])
def test_a_step_adds_the_references_deltas_on_either_path(dtype, num_tokens, batch_variant):
    """With PAGEDSERVE_BATCH_VARIANT=1 the step's size picks the path (by default every step
    takes the masked one: tests/engine/test_one_answer_engine.py)."""
    step, projection = _projection(dtype)
    # The masked path's weights are packed exactly where this CPU packs the dtype.
    assert is_packed(projection.a_flat) == can_pack(torch.device("cpu"), dtype)
    slots = np.arange(num_tokens) % (SLOTS + 1) - 1  # NO_SLOT, 0, 1, 2, NO_SLOT, ...
    step.set(slots)
    fewest, most = DENSE_TOKENS[dtype]
    assert (step.mask is not None) == (fewest <= num_tokens <= most)
    assert (step.groups != []) == (step.mask is None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, IN_FEATURES, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(PARTS), generator=gen).to(dtype)
    got, want = y.clone(), y.clone()
    projection.add(got, x)
    lora_add_reference(want, x, torch.from_numpy(slots), projection.a, projection.b, PARTS)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    base = torch.from_numpy(slots == NO_SLOT)
    assert torch.equal(got[base], y[base])
    assert not torch.equal(got[~base], y[~base])
