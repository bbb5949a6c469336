"""oneDNN-packed bf16 and float32 linears on CPU: same results as F.linear up to rounding, used
by the CPU engine in both dtypes where the CPU lets oneDNN pack them (float32 everywhere, bf16
where `kernels/cpu_features.py` `onednn_bf16`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.cpu_linear import can_pack, is_packed, linear, pack, unpack
from pagedserve.kernels import cpu_features

PACKS_BF16 = can_pack(torch.device("cpu"), torch.bfloat16)
needs_onednn_bf16 = pytest.mark.skipif(
    not PACKS_BF16,
    reason="needs oneDNN bf16 (avx512bw/vl/dq or avx_ne_convert): this CPU/level has "
    f"{cpu_features.cpu_features().level}, where bf16 weights stay plain for F.linear",
)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16), requires_grad=False)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = F.linear(x, w, b)
    assert pack(w) and is_packed(w)
    got = linear(x, w, b)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    # Both accumulate in fp32 and round once to bf16; the order may differ by one bf16 ulp.
    torch.testing.assert_close(got, expected, atol=0, rtol=2**-7)
    # float32 inputs (e.g. a reference path) fall back to F.linear on the plain weight.
    x32 = x.float()
    torch.testing.assert_close(linear(x32, w.float()), F.linear(x32, w.float()))


@pytest.mark.parametrize("rows", [1, 64])
def test_packed_float32_linear_matches_f_linear_to_rounding(rows):
    torch.manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(3072, 576), requires_grad=False)
    x = torch.randn(rows, 576)
    expected = F.linear(x, w)
    assert pack(w)
    got = linear(x, w)
    # float32 accumulation in another order: a few ulps of outputs of size ~100.
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-5)
    assert not torch.equal(got, expected) or rows == 1  # it did go through oneDNN's kernel


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D bfloat16 or float32 CPU"):
        pack(torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float16), requires_grad=False))
    with pytest.raises(ValueError, match="2-D bfloat16 or float32 CPU"):
        pack(torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    assert can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.bfloat16)
    # Where oneDNN has no bf16 kernels, pack leaves a bf16 weight plain instead of raising.
    w = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16), requires_grad=False)
    assert pack(w) is PACKS_BF16 and is_packed(w) is PACKS_BF16


def test_bf16_packing_follows_the_cpu_level(monkeypatch):
    # torch's reorder raises on bf16 where the CPU lacks avx512bw/vl/dq and avx_ne_convert; an
    # AVX2 level (forced, or the CPU's own) must never reach it.
    monkeypatch.setattr(cpu_features, "onednn_bf16_level", lambda features=None: False)
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert can_pack(torch.device("cpu"), torch.float32)
    w = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16), requires_grad=False)
    assert not pack(w) and not is_packed(w)
    torch.testing.assert_close(linear(torch.ones(2, 8, dtype=torch.bfloat16), w),
                               torch.full((2, 8), 8.0, dtype=torch.bfloat16))  # fmt: skip


def test_bf16_engine_packs_and_generates_like_unpacked(tiny_llama_dir):
    # Packed where oneDNN has bf16 kernels; elsewhere plain, and both paths give the same tokens.
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.core.worker.model
    assert all(is_packed(layer.mlp.down_proj) is PACKS_BF16 for layer in model.layers)
    assert is_packed(model.lm_head) is PACKS_BF16
    prompts = [[5, 9, 13, 2 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    packed_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for layer in model.layers:  # drop the packed copies: plain F.linear from here on
        for w in (attn := layer.self_attn).qkv_proj, attn.o_proj, *_mlp(layer):
            unpack(w)
    unpack(model.lm_head)
    assert not is_packed(model.layers[0].mlp.down_proj)
    plain_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert packed_out == plain_out
    fp32 = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    assert is_packed(fp32.engine.core.worker.model.layers[0].mlp.down_proj)


def _mlp(layer):
    return layer.mlp.gate_up_proj, layer.mlp.down_proj
