"""Mixture of experts: the torch reference (kernels.reference.moe_route / fused_moe) against
transformers' own sparse MoE blocks (Qwen3-MoE, Mixtral), and the fused Triton kernels
(kernels.triton_moe) against the reference.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py). Dtypes: float32 and bfloat16; under the interpreter the kernels work around
its bfloat16 dot and cast (see the kernels' docstring), so bfloat16 checks the rounding too.

Tolerance (`assert_matches`): float32 within 1e-5 (the kernels sum the matmuls in another order
than torch); bfloat16 within two ulps and bit-identical in all but 1% of the elements, which
shows the kernels round where the reference rounds.
"""

from __future__ import annotations

import random
import unittest.mock
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedserve.kernels import reference, triton_attention, triton_moe
from pagedserve.kernels.triton_moe import MoeConfig

needs_interpreter = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `python -m benchmarks.gpu_kernels --only moe` "
    "checks the kernels",
)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: |got - want| <= 1e-5 (1 + |want|). bfloat16: within two ulps (rtol twice the
    machine epsilon; atol one subnormal ulp), and at most 1% of the elements (2 in small
    tensors) differ at all."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    info = torch.finfo(got.dtype)
    torch.testing.assert_close(got, want, atol=info.smallest_normal * info.eps, rtol=2 * info.eps)
    differ = int((got != want).sum())
    assert differ <= max(2, want.numel() // 100), f"{differ} of {want.numel()} elements differ"


# --------------------------------------------------------------- reference vs transformers


def _randomise(block: torch.nn.Module, seed: int) -> None:
    """Every parameter N(0, 1 / fan_in): the experts' weights are torch.empty, the router's
    zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def _blocks() -> list[tuple[str, torch.nn.Module, int, bool]]:
    """(name, block, top_k, renormalize) for transformers' sparse MoE blocks."""
    sizes = {"hidden_size": 32, "num_experts_per_tok": 2, "experts_implementation": "eager"}
    blocks = []
    for norm in (True, False):
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=24, num_experts=8, norm_topk_prob=norm, **sizes
        )
        blocks.append((f"qwen3-moe-norm-{norm}", Qwen3MoeSparseMoeBlock(config), 2, norm))
    config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=8, **sizes)
    blocks.append(("mixtral", MixtralSparseMoeBlock(config), 2, True))  # Mixtral renormalises
    return blocks


@pytest.mark.parametrize(
    "name, block, top_k, renormalize", [pytest.param(*b, id=b[0]) for b in _blocks()]
)
def test_reference_equals_transformers_moe_block(name, block, top_k, renormalize):
    # Same loop over the experts, same rounding: float32 is bit-identical. 11 tokens over 8
    # experts with 2 each: some experts get several tokens, the order of the top-k ids differs
    # from the experts' order.
    _randomise(block.eval(), seed=len(name))
    x = randn(11, 32, seed=1)
    with torch.no_grad():
        want = block(x[None])[0]
        gate = block.gate.weight
        experts = block.experts
        weights, ids = reference.moe_route(x @ gate.T, top_k, renormalize)
        got = reference.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    else:
        assert bool((weights.sum(-1) < 1).all())
    assert torch.equal(got, want)


def test_reference_equals_transformers_in_bfloat16():
    # Mixtral keeps the routing weights in float32, as the reference does: bit-identical.
    # Qwen3-MoE rounds them to the model dtype first (router_top_value.to(router_logits.dtype));
    # passing the weights rounded the same way makes the reference bit-identical to it too.
    for name, block, top_k, renormalize in _blocks()[::2]:  # qwen3 (normalised), mixtral
        _randomise(block, seed=3)
        block = block.to(torch.bfloat16).eval()
        x = randn(9, 32, seed=4).to(torch.bfloat16)
        with torch.no_grad():
            want = block(x[None])[0]
            weights, ids = reference.moe_route(F.linear(x, block.gate.weight), top_k, renormalize)
            if name.startswith("qwen3"):
                weights = weights.to(torch.bfloat16).float()
            experts = block.experts
            got = reference.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        assert torch.equal(got, want), name


# ----------------------------------------------------------------------- Triton vs reference


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    activation: str = "silu"
    ids_dtype: torch.dtype = torch.int64
    starved: tuple[int, ...] = ()  # experts the router never picks
    gate_scale: float = 1.0  # > 1 drives the activation into its tails
    config: MoeConfig | None = None  # None: the default of moe_config


SMALL_TILES = MoeConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# Sizes are not multiples of the default tiles (BLOCK_N 32/64, BLOCK_K 64/32) unless said.
CASES = [
    Case("decode-1-token", 1, 32, 24, 8, 2),
    Case("decode-3-tokens-top4-gelu", 3, 40, 24, 8, 4, "gelu_tanh", torch.int32, gate_scale=4.0),
    # More tokens than experts: the default switches to 64-row tiles.
    Case("prefill-24-tokens", 24, 48, 40, 8, 2),
    Case("starved-experts", 6, 32, 24, 8, 2, ids_dtype=torch.int32, starved=(0, 3, 7)),
    Case("top1", 5, 32, 24, 4, 1, "gelu_tanh"),
    # 60 pairs over 3 experts in 16-row tiles: several tiles per expert, two reduction steps
    # over hidden (32 = 2 x 16) and a ragged last one over inter (24 = 16 + 8), two column tiles.
    Case("small-tiles", 30, 32, 24, 3, 2, ids_dtype=torch.int32, config=SMALL_TILES),
]


def _inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple:
    h, i, e = case.hidden, case.inter, case.num_experts
    x = randn(case.num_tokens, h, seed=seed).to(dtype)
    gate_up = randn(e, 2 * i, h, seed=seed + 1, scale=h**-0.5)
    gate_up[:, :i] *= case.gate_scale
    down = randn(e, h, i, seed=seed + 2, scale=i**-0.5).to(dtype)
    logits = randn(case.num_tokens, e, seed=seed + 3)
    logits[:, list(case.starved)] = -1e4
    weights, ids = reference.moe_route(logits, case.top_k, renormalize=True)
    return x, gate_up.to(dtype), down, weights, ids.to(case.ids_dtype)


def _triton(case: Case, *args: torch.Tensor) -> torch.Tensor:
    if case.config is None:
        return triton_moe.fused_moe(*args, activation=case.activation)
    return triton_moe.experts(*args, case.activation, case.config)


@needs_interpreter
# numpy's warning for exp(-2 * inner) = inf in GELU's far negative tail, where x / inf = -0 is
# the right answer (as on a GPU).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_equals_reference(case, dtype):
    args = _inputs(case, dtype)
    ids = args[-1]
    if case.starved:
        assert not bool(torch.isin(ids, torch.tensor(case.starved)).any())
    got = _triton(case, *args)
    want = reference.fused_moe(*args, activation=case.activation)
    assert_matches(got, want)
    assert bool(want.abs().amax(-1).gt(0).all())  # every token got something


@needs_interpreter
def test_default_config_follows_the_batch():
    # Decode batches (no more tokens than experts) get 16-row tiles, larger ones 64.
    assert triton_moe.moe_config(1, 8, 128).block_m == 16
    assert triton_moe.moe_config(128, 8, 128).block_m == 16
    assert triton_moe.moe_config(129, 8, 128).block_m == 64
    assert triton_moe.moe_config(16, 2, 8).block_m == 64


@needs_interpreter
def test_no_tokens_and_no_host_sync():
    case = CASES[0]
    x, gate_up, down, weights, ids = _inputs(case, torch.float32)
    empty = triton_moe.fused_moe(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, 32)
    # Nothing in the wrapper reads a tensor's value back to the host (as .item(), .tolist() or
    # a Python bool/int would on CUDA), so a CUDA graph can capture it.
    want = reference.fused_moe(x, gate_up, down, weights, ids)

    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    host_reads = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    with unittest.mock.patch.multiple(torch.Tensor, **dict.fromkeys(host_reads, sync)):
        got = triton_moe.fused_moe(x, gate_up, down, weights, ids)
    assert_matches(got, want)


def test_align_sorts_pairs_by_expert_and_pads_each_run():
    # The module docstring's example: pairs 0..5 routed to experts 3 1 0 1 3 3 (top_k 2: tokens
    # 0..2), 4 experts, 2-row tiles. Expert 2 gets no tile; the worst case over 6 pairs and
    # 4 experts is 5 tiles, so one tile past the end is marked with expert 4.
    P = 6
    ids = torch.tensor([[3, 1], [0, 1], [3, 3]])
    sorted_pair_ids, block_experts = triton_moe.align(ids, num_experts=4, block_m=2)
    assert sorted_pair_ids.tolist() == [2, P, 1, 3, 0, 4, 5, P, P, P]
    assert block_experts.tolist() == [0, 1, 3, 3, 4]
    assert sorted_pair_ids.dtype == block_experts.dtype == torch.int32


def test_max_blocks_bounds_every_routing_and_is_reached():
    rng = random.Random(0)
    for _ in range(300):
        num_experts, block_m = rng.randint(1, 12), rng.choice([1, 2, 4, 16])
        num_pairs = rng.randint(0, 80)
        bound = triton_moe._max_blocks(num_pairs, num_experts, block_m)
        counts = [0] * num_experts
        for _ in range(num_pairs):
            counts[rng.randrange(num_experts)] += 1
        assert sum(-(-c // block_m) for c in counts) <= bound
        # Reached: all but (E - 1) pairs to one expert, one pair to each other.
        most = min(num_experts, num_pairs)
        worst = [num_pairs - most + 1] + [1] * (most - 1) if most else []
        assert sum(-(-c // block_m) for c in worst) == bound
    # One decode token, top 8 of 128 experts: 8 tiles, not (8 + 128 * 15) / 16.
    assert triton_moe._max_blocks(8, 128, 16) == 8


# -------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("op", [reference.fused_moe, triton_moe.fused_moe], ids=["ref", "triton"])
def test_bad_arguments_raise_value_errors_naming_them(op):
    x, gate_up, down = torch.zeros(5, 32), torch.zeros(8, 48, 32), torch.zeros(8, 32, 24)
    weights, ids = torch.full((5, 2), 0.5), torch.zeros(5, 2, dtype=torch.int64)
    good = {"x": x, "gate_up": gate_up, "down": down, "topk_weights": weights, "topk_ids": ids}
    bad = [
        ({"x": torch.zeros(32)}, r"x must be \[num_tokens, hidden\]"),
        ({"x": torch.zeros(5, 32, dtype=torch.int64)}, "x must be a floating-point tensor"),
        ({"gate_up": torch.zeros(8, 48, 16)}, r"gate_up must be \[num_experts, 2 \* inter"),
        ({"gate_up": torch.zeros(8, 47, 32)}, r"gate_up must be \[num_experts, 2 \* inter"),
        ({"down": torch.zeros(8, 24, 32)}, r"down must be \[8, 32, 24\] to match gate_up"),
        ({"gate_up": gate_up.half()}, "gate_up dtype torch.float16 differs from x dtype"),
        ({"down": torch.zeros(8, 24, 32).transpose(1, 2)}, "down must be contiguous"),
        ({"topk_weights": torch.zeros(4, 2)}, r"topk_weights must be \[5, top_k\]"),
        ({"topk_weights": weights.bfloat16()}, "topk_weights must be float32"),
        ({"topk_ids": torch.zeros(5, 3, dtype=torch.int64)}, r"topk_ids must be \(5, 2\) like"),
        ({"topk_ids": ids.float()}, "topk_ids must be int32 or int64"),
        ({"topk_ids": ids.to("meta")}, "all tensors must be on one device"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            op(**(good | change))
    with pytest.raises(ValueError, match="activation must be 'silu' or 'gelu_tanh', got 'relu'"):
        op(**good, activation="relu")
