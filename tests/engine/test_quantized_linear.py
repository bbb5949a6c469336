"""Quantized weights kept as a GGUF file's blocks on CPU (engine/models/quantized_linear.py,
kernels/csrc/cpu_gguf.cpp), for every kept block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K): the blocks are the file's bytes and dequantize to gguf's values, the block dot
products equal a float64 product of the weights by the activations quantized as the kernel
quantizes them (int8 per block of 32), the dense route of longer steps equals F.linear of the
dequantized weight, a weight stacked from parts of different types multiplies each into its own
columns, tiny Llama GGUFs (one type throughout, and a Q4_K_M-like mix) run through the engine with
every matmul weight kept and score their tokens as the dense model of the same values does, and
the real SmolLM2 Q4_1 file keeps its 92 MiB. The suite runs this file at the CPU's own level (VNNI
where it has it) and, through tests/engine/test_lesser_cpu.py, at the avx2 level (vpmaddubsw).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pagedserve.engine.models.quantized_linear as ql
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.hf_config import config_from_json_file
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.quantized_linear import (
    BlockWeight,
    QuantizedRows,
    block_dot_isa,
    gguf_rows,
    keep_quantized,
    quantized,
)
from pagedserve.kernels import cpu_features
from tests import kquants
from tests.gguf_writer import write_gguf_like_llama_cpp

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_block_dot = pytest.mark.skipif(
    not block_dot_isa(),
    reason="the block matmuls need a C++ compiler and level avx2 or above: this CPU/level has "
    f"{cpu_features.cpu_features().level}",
)
needs_amx = pytest.mark.skipif(
    not ql.amx_tiles(),
    reason="the AMX route needs a CPU with AMX-BF16 (Intel Xeon of the 4th generation or later) "
    "and the kernels built natively for it: this machine's build has no AMX",
)


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _cols(qtype: Q) -> int:
    """A K for tests of `qtype`: 5 blocks of 32, or 2 super-blocks of 256."""
    return 512 if qtype in K_QUANTS else 160


def _original(n: int, k: int, seed: int) -> np.ndarray:
    """The float32 weight `_file_weight` quantizes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[3, :40] *= 20  # a row with an outlier region
    return w


def _file_weight(qtype: Q, n: int = 128, k: int = 96, seed: int = 0):
    """A random [n, k] weight quantized by gguf (tests/kquants.py for Q4_K / Q6_K): (its blocks,
    gguf's dequantized values)."""
    data = kquants.quantize(_original(n, k, seed), qtype)
    return data, torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k).copy())


def _weight(qtype: Q, n: int = 128, k: int = 96, seed: int = 0) -> BlockWeight:
    return BlockWeight(gguf_rows(_file_weight(qtype, n, k, seed)[0], qtype, (n, k)))


# The activations' largest code (kCodeMax in cpu_gguf.cpp): 127 * 255 + 127, two int8 halves.
CODE_MAX = 32512.0


def _activations_as_quantized(x: torch.Tensor) -> torch.Tensor:
    """x in float64 as the kernel multiplies it: each block of 32 rounded to dx * code, dx =
    max|x| / 32512, a 15-bit code (in float32, as the kernel computes it: cpu_gguf.cpp)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, CODE_MAX / top, torch.zeros_like(top))
    codes = torch.round(blocks * inverse)
    return (codes.double() * (top / CODE_MAX).double()).view(x.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_gguf_blocks_are_the_files_bytes_and_dequantize_to_ggufs_values(qtype):
    k = 512 if qtype in K_QUANTS else 96
    data, values = _file_weight(qtype, k=k)
    rows = gguf_rows(data, qtype, (128, k))
    assert rows.blocks.dtype == torch.uint8 and rows.blocks.shape[0] == 128
    assert rows.blocks.numpy().tobytes() == np.asarray(data).tobytes()
    assert torch.equal(rows.dequantize(), values)
    # The test quantizer's blocks hold the weight's values (round to nearest: within one step).
    assert (values[4:] - torch.from_numpy(_original(128, k, 0)[4:])).abs().max() < 0.05
    weight = BlockWeight(rows)
    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert np.asarray(data).nbytes == 128 * k // values_per_block * block_bytes
    # Q4_K's interleaved groups hold each block's scales as bytes: 1184 bytes for 1152.
    grown = 1184 / 1152 if qtype == Q.Q4_K else 1
    assert weight.nbytes == np.asarray(data).nbytes * grown
    if block_dot_isa():
        assert torch.equal(weight.dequantize(), values)
        assert torch.equal(weight.dequantize(torch.bfloat16), values.bfloat16())
        ids = torch.tensor([3, 0, 127, 3])
        assert torch.equal(weight.embedding(ids, torch.float32), values[ids])


@pytest.mark.parametrize("qtype", ql.KEPT_TYPES)
def test_random_blocks_dequantize_to_ggufs_values(qtype):
    """Blocks of random codes and scales (every bit pattern of the codes, Q5_K's too, which no
    quantizer here writes)."""
    k = _cols(qtype)
    blocks = kquants.random_blocks(qtype, 37, k, seed=int(qtype))
    values = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(37, k).copy())
    rows = gguf_rows(blocks, qtype, (37, k))
    assert torch.equal(rows.dequantize(), values)
    if block_dot_isa():
        assert torch.equal(BlockWeight(rows).dequantize(), values)
        assert torch.equal(BlockWeight(rows).dequantize(torch.bfloat16), values.bfloat16())


def test_unsupported_blocks_and_shapes_are_refused():
    with pytest.raises(ValueError, match="Q3_K weights are not kept quantized; kept: Q4_0, Q4_1"):
        gguf_rows(np.zeros(110, np.uint8), Q.Q3_K, (1, 256))
    with pytest.raises(ValueError, match="K divisible by 32"):
        gguf_rows(np.zeros(10, np.uint8), Q.Q8_0, (2, 40))
    with pytest.raises(ValueError, match=r"a Q4_K weight needs K divisible by 256, got \(2, 576\)"):
        gguf_rows(np.zeros(10, np.uint8), Q.Q4_K, (2, 576))
    q4 = gguf_rows(_file_weight(Q.Q4_1, n=96)[0], Q.Q4_1, (96, 96))
    q8 = gguf_rows(_file_weight(Q.Q8_0)[0], Q.Q8_0, (128, 96))
    # Runs of one type join; another type starts a part of its own.
    (joined,) = QuantizedRows.stack([q4, q4])
    assert joined.shape == (192, 96) and joined.qtype == Q.Q4_1
    parts = QuantizedRows.stack([q4, q4, q8, q4])
    assert [(p.qtype, p.shape[0]) for p in parts] == [(Q.Q4_1, 192), (Q.Q8_0, 128), (Q.Q4_1, 96)]


@needs_block_dot
@pytest.mark.parametrize("qtype", ql.KEPT_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_dot_products_equal_a_float64_product_on_the_quantized_activations(qtype, dtype):
    """Every tile shape (4 weight rows by 1 to 4 activation rows, and the remainders: 67 rows of
    weights, 1 to 9 of activations), on random blocks (every code's bit pattern)."""
    k = _cols(qtype)
    weight = BlockWeight(gguf_rows(kquants.random_blocks(qtype, 67, k, seed=5), qtype, (67, k)))
    for rows in range(1, 10):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[0, :32] = 0.0  # a block of zeros (dx = 0)
        expected = _activations_as_quantized(x) @ weight.dequantize().double().T
        out = torch.empty(rows, 67, dtype=dtype)
        torch.ops.pagedserve_cpu.gguf_block_linear(x, weight.parts[0].blocks, int(qtype), out)
        # float32 sums of 5 to 16 blocks; bfloat16 outputs rounded once.
        scale = expected.abs().max().item()
        tolerance = scale * (1e-5 if dtype == torch.float32 else 2**-8)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=tolerance)


@needs_block_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_block_dot_for_few_rows_and_the_dequantized_weight_for_more(
    dtype, monkeypatch, batch_variant
):
    """With --batch-variant, without AMX (the AMX route's own test is below)."""
    monkeypatch.setattr(ql, "amx_tiles", lambda: False)
    weight = _weight(Q.Q4_1, n=192, k=128)
    assert weight.interleaved  # rows interleaved by 8 (tests/engine/test_interleaved_rows.py)
    bias = torch.randn(192).to(dtype)
    most = ql.BLOCK_DOT_MAX_ROWS[dtype]
    dense = weight.dequantize(dtype)
    for rows in (1, most, most + 1, 200):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = weight.linear(x, bias)
        assert out.dtype == dtype and out.shape == (rows, 192)
        if rows > most:  # the same call F.linear makes on the dequantized weight
            assert torch.equal(out, F.linear(x, dense) + bias)
        else:
            expected = torch.empty(rows, 192, dtype=dtype)
            torch.ops.pagedserve_cpu.gguf_block_linear(
                x, weight.parts[0].blocks, weight.parts[0].kernel_type, expected
            )
            assert torch.equal(out, expected + bias)
    # A weight larger than the scratch budget is dequantized a slab of rows at a time.
    x = torch.randn(40, 128).to(dtype)
    whole = weight.linear(x)
    monkeypatch.setattr(ql, "SCRATCH_BYTES", 50 * 128 * x.element_size())  # slabs of 48 rows
    assert torch.equal(weight.linear(x), whole)


@needs_block_dot
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K])  # interleaved rows and the file's
def test_float_out_gives_the_block_dots_sums_before_bfloat16_rounds_them(
    qtype, monkeypatch, batch_variant
):
    """The lm_head's logits (`Model.compute_logits`): bfloat16 activations, float32 out."""
    monkeypatch.setattr(ql, "amx_tiles", lambda: False)
    k = _cols(qtype)
    weight = BlockWeight(gguf_rows(kquants.random_blocks(qtype, 64, k, seed=3), qtype, (64, k)))
    most = ql.BLOCK_DOT_MAX_ROWS[torch.bfloat16]
    for rows in (1, 3, most):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        sums = weight.linear(x, float_out=True)
        assert sums.dtype == torch.float32 and sums.shape == (rows, 64)
        # The float32 sums the bfloat16 output is rounded from, once: those of float32
        # activations of the same values, not rounded to bfloat16.
        assert torch.equal(sums.bfloat16(), weight.linear(x))
        assert torch.equal(sums, weight.linear(x.float()))
        assert not torch.equal(sums, sums.bfloat16().float())
    x = torch.randn(most + 1, k).bfloat16()  # the dense route: its bfloat16 result as float32
    assert torch.equal(weight.linear(x, float_out=True), weight.linear(x).float())
    out = torch.empty(1, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="of x's dtype or float32"):
        torch.ops.pagedserve_cpu.gguf_block_linear(
            x[:1], weight.parts[0].blocks, weight.parts[0].kernel_type, out
        )


@needs_block_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_of_parts_of_different_types_multiplies_each_into_its_columns(
    dtype, monkeypatch, batch_variant
):
    """A fused q/k/v as llama.cpp's Q4_K_M files store some layers': q and k in Q5_0 (rows of
    576 values fall back from Q4_K), v in Q8_0. The block dot products and the dense route (the
    AMX route's test below covers parts too)."""
    monkeypatch.setattr(ql, "amx_tiles", lambda: False)
    q, k, v = (
        gguf_rows(kquants.random_blocks(qtype, n, 64, seed=n), qtype, (n, 64))
        for qtype, n in ((Q.Q5_0, 48), (Q.Q5_0, 16), (Q.Q8_0, 24))
    )
    weight = BlockWeight(QuantizedRows.stack([q, k, v]))
    assert weight.kinds == ["Q5_0", "Q8_0"]
    assert (weight.out_features, weight.in_features) == (88, 64)
    assert weight.nbytes == q.blocks.nbytes + k.blocks.nbytes + v.blocks.nbytes
    singles = [BlockWeight(part) for part in (q, k, v)]
    assert torch.equal(weight.dequantize(dtype), torch.cat([w.dequantize(dtype) for w in singles]))
    most = ql.BLOCK_DOT_MAX_ROWS[dtype]
    for rows in (1, 3, most):  # the block dot products: each output is its own row's
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert torch.equal(weight.linear(x), torch.cat([w.linear(x) for w in singles], dim=1))
    x = torch.randn(most + 5, 64).to(dtype)
    dense = F.linear(x, weight.dequantize(dtype))
    torch.testing.assert_close(weight.linear(x), dense)
    monkeypatch.setattr(ql, "SCRATCH_BYTES", 10 * 64 * x.element_size())  # slabs of 10 rows
    torch.testing.assert_close(weight.linear(x), dense)


@needs_amx
@pytest.mark.parametrize("qtype", ql.KEPT_TYPES)
def test_amx_tiles_multiply_by_the_weights_dequantized_to_bf16(qtype):
    k, n = _cols(qtype), 37  # a partial tile of weight rows
    weight = BlockWeight(gguf_rows(kquants.random_blocks(qtype, n, k, seed=7), qtype, (n, k)))
    blocks, dense = weight.parts[0].blocks, weight.dequantize(torch.bfloat16)
    amx_linear = torch.ops.pagedserve_cpu.gguf_amx_linear
    # Rows of the identity give the weight back exactly (one product each, rounded once): the
    # tiles hold the values the dense route's dequantizing gives.
    out = torch.empty(k, n, dtype=torch.bfloat16)
    amx_linear(torch.eye(k, dtype=torch.bfloat16), blocks, int(qtype), out)
    assert torch.equal(out, dense.T)
    for rows in (1, 15, 16, 17, 64, 65, 130):  # partial chunks, passes of 4 chunks and more
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        expected = x.double() @ dense.double().T
        wide = torch.full((rows, n + 5), 7.0, dtype=torch.bfloat16)
        amx_linear(x, blocks, int(qtype), wide[:, 2 : 2 + n])  # columns of wider rows
        # float32 sums of bf16 products, the output rounded to bf16 once.
        tolerance = expected.abs().max().item() * 2**-8
        torch.testing.assert_close(wide[:, 2 : 2 + n].double(), expected, rtol=0, atol=tolerance)
        assert (wide[:, :2] == 7).all() and (wide[:, 2 + n :] == 7).all()


@needs_amx
def test_bf16_linear_takes_the_amx_tiles_between_few_rows_and_long_steps(batch_variant):
    q4, q8 = _file_weight(Q.Q4_1, n=96, k=128)[0], _file_weight(Q.Q8_0, n=40, k=128)[0]
    weight = BlockWeight([gguf_rows(q4, Q.Q4_1, (96, 128)), gguf_rows(q8, Q.Q8_0, (40, 128))])
    dense = weight.dequantize(torch.bfloat16)
    ops = torch.ops.pagedserve_cpu
    assert weight.interleaved  # both parts: their crossover
    routes = [
        (ql.INTERLEAVED_AMX_MIN_ROWS, ops.gguf_block_linear),
        (ql.INTERLEAVED_AMX_MIN_ROWS + 1, ops.gguf_amx_linear),
        (ql.AMX_MAX_ROWS, ops.gguf_amx_linear),
        (ql.AMX_MAX_ROWS + 1, None),  # the dense route
    ]
    for rows, op in routes:
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = weight.linear(x)
        if op is None:
            assert torch.equal(out, F.linear(x, dense))
            continue
        expected = torch.empty(rows, 136, dtype=torch.bfloat16)
        for part, start in ((weight.parts[0], 0), (weight.parts[1], 96)):
            op(x, part.blocks, part.kernel_type, expected[:, start : start + part.shape[0]])
        assert torch.equal(out, expected)


@needs_block_dot
def test_other_activation_dtypes_are_refused():
    with pytest.raises(ValueError, match="multiply float32 or bfloat16, got torch.float16"):
        _weight(Q.Q8_0).linear(torch.zeros(1, 96, dtype=torch.float16))


@pytest.mark.parametrize(
    "quantization, kind, device, dtype, sharded, expected",
    [
        ("none", "gguf", "cpu", torch.bfloat16, False, False),
        ("auto", "gguf", "cpu", torch.float16, False, False),
        ("auto", "hf_dir", "cpu", torch.bfloat16, False, False),
        ("auto", "gguf", "cuda", torch.bfloat16, False, False),
        ("auto", "gguf", "cpu", torch.bfloat16, True, False),
    ],
)
def test_when_weights_are_not_kept_quantized(quantization, kind, device, dtype, sharded, expected):
    assert keep_quantized(quantization, kind, torch.device(device), dtype, sharded) is expected


@needs_block_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_keeps_a_gguf_file_quantized_on_cpu_in_either_dtype(dtype):
    assert keep_quantized("auto", "gguf", CPU, dtype, sharded=False)
    assert keep_quantized("gguf", "gguf", CPU, dtype, sharded=False)


def test_without_the_block_matmuls_auto_dequantizes_and_gguf_says_why(monkeypatch):
    monkeypatch.setattr(ql, "block_dot_isa", lambda: "")
    assert not keep_quantized("auto", "gguf", CPU, torch.float32, sharded=False)
    with pytest.raises(ValueError, match=r"no compiled matmuls by GGUF blocks \(they need a C"):
        keep_quantized("gguf", "gguf", CPU, torch.float32, sharded=False)


def test_gguf_where_it_cannot_apply_says_what_to_change():
    with pytest.raises(ValueError) as info:
        keep_quantized("gguf", "hf_dir", torch.device("cuda"), torch.float16, sharded=True)
    assert str(info.value) == (
        "--quantization gguf cannot keep the weights quantized: the model is not a GGUF file; "
        "quantized matmuls run on CPU, the device is cuda; they multiply float32 or bfloat16 "
        "activations, the dtype is torch.float16; tensor parallelism slices dequantized weights "
        "(use --quantization none, or auto to decide per run)"
    )
    with pytest.raises(ValueError, match="quantization must be one of"):
        keep_quantized("awq", "gguf", CPU, torch.bfloat16, sharded=False)


# ---- through the engine ------------------------------------------------------------------------


def _tiny_llama(folder, hidden: int, initializer_range: float) -> tuple[ModelConfig, dict]:
    """A random tied-embedding Llama of 2 layers, 4 heads and 2 KV heads, saved in `folder`:
    its config and weights."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=256, initializer_range=initializer_range,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return config_from_json_file(folder / "config.json"), hf.state_dict()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama whose matmul weights have 64-multiple output features, and its GGUF files in
    Q4_1 and Q8_0 (q/k rows permuted as llama.cpp writes them)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config, weights = _tiny_llama(folder, hidden=64, initializer_range=0.3)
    return {
        qtype.name: write_gguf_like_llama_cpp(
            folder / f"tiny.{qtype.name}.gguf", config, weights, tensor_type=qtype
        )
        for qtype in (Q.Q4_1, Q.Q8_0)
    }


def _llm(path, quantization: str, dtype: str) -> LLM:
    return LLM(
        str(path), device="cpu", dtype=dtype, quantization=quantization, num_kv_blocks=64,
        block_size=4, max_model_len=64, max_num_batched_tokens=64,
    )  # fmt: skip


def _greedy(llm: LLM, prompts, n: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _token_logprobs(llm: LLM, sequences) -> list[float]:
    """The log-probability of each token of `sequences` after its prefix (prompt logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    values = []
    for seq, out in zip(sequences, llm.generate(sequences, params), strict=True):
        values += [
            entry[token].logprob
            for token, entry in zip(seq[1:], out.prompt_logprobs[1:], strict=True)
        ]
    return values


# Prompts of 1 to 30 tokens, run together: steps of few rows (decode, short prompts: the block dot
# products) and of many (the 30-token prompt, the prompt-logprob passes: the dequantized weights).
PROMPTS = [[5], [7, 8, 9, 10, 11], list(range(20, 33)), list(range(40, 70))]


def _kept_and_dense(path, dtype: str) -> tuple[LLM, LLM]:
    """Engines of the file with its weights kept and dequantized at load; checks that they hold
    the same values and that each token of the dense model's greedy continuations is about as
    likely under the kept weights (a weight in the wrong place would move them by nats; greedy
    tokens alone are no test: sums moved by the activations' int8 rounding flip near-ties)."""
    kept, dense = _llm(path, "gguf", dtype), _llm(path, "none", dtype)
    model = kept.engine.core.worker.model
    assert all(quantized(p) is None for p in dense.engine.core.worker.model.matmul_weights())
    for param, kept_param in zip(
        dense.engine.core.worker.model.matmul_weights(), model.matmul_weights(), strict=True
    ):
        weight = quantized(kept_param)
        if weight is None:  # a part not kept: the whole weight dequantized, as `none` has it
            assert torch.equal(kept_param, param)
        else:
            assert kept_param.numel() == 0
            assert torch.equal(param, weight.dequantize().to(param.dtype))
    sequences = [p + t for p, t in zip(PROMPTS, _greedy(dense, PROMPTS), strict=True)]
    expected, got = _token_logprobs(dense, sequences), _token_logprobs(kept, sequences)
    assert len(got) == sum(len(s) - 1 for s in sequences) and min(expected) < -1.0
    differences = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    # Measured at the avx512_bf16 level (VNNI, AMX): Q4_1 float32 0.19 apart at most, 0.013 on
    # average; the Q4_K_M mix in float32 0.16, 0.0087; Q8_0 bfloat16 0.0 with AMX (the prompt
    # passes multiply by the weights dequantized to bf16, as the dense model does), 0.04, 0.002
    # without; at the avx2 level (vpmaddubsw) the same sums.
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
    return kept, dense


@needs_block_dot
@pytest.mark.parametrize("qtype, dtype", [("Q4_1", "float32"), ("Q8_0", "bfloat16")])
def test_a_gguf_model_runs_with_its_matmul_weights_kept_quantized(tiny_llama, qtype, dtype, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        kept, _ = _kept_and_dense(tiny_llama[qtype], dtype)
    model = kept.engine.core.worker.model
    for layer in model.layers:
        for param in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):  # fmt: skip
            assert quantized(param).kinds == [qtype]
    qkv = quantized(model.layers[0].self_attn.qkv_proj)
    assert (qkv.out_features, qkv.in_features) == (128, 64)
    # A tied embedding is also the lm_head: kept too, its lookups dequantize their rows.
    assert quantized(model.embed_tokens).kinds == [qtype] and model.embed_tokens.numel() == 0
    assert f"quantized matmul weights kept as the GGUF file's blocks (9 {qtype})" in caplog.text
    # Every matmul weight has whole groups of 8 rows: all interleaved, and routed so.
    assert all(quantized(p).interleaved for p in model.parameters() if quantized(p) is not None)
    by_blocks = f"multiply by the blocks ({block_dot_isa()}, rows interleaved by 8)"
    # By default one route whatever the step (the batch-variant routes: the next test).
    routes = f"steps of any rows {by_blocks}, each row's result its own"
    assert routes in caplog.text


@needs_block_dot
def test_the_log_line_names_the_batch_variant_routes(batch_variant):
    weight = _weight(Q.Q4_1, n=192, k=128)
    by_blocks = f"multiply by the blocks ({block_dot_isa()}, rows interleaved by 8)"
    for dtype in ql.ACTIVATION_DTYPES:
        if dtype == torch.bfloat16 and ql.amx_tiles():
            routes = (
                f"steps of up to {ql.INTERLEAVED_AMX_MIN_ROWS} rows {by_blocks}, up to "
                f"{ql.AMX_MAX_ROWS} by AMX bf16 tiles of weights dequantized in cache, longer ones"
                " by the weights dequantized"
            )
        else:
            rows = ql.BLOCK_DOT_MAX_ROWS[dtype]
            routes = (
                f"steps of up to {rows} rows {by_blocks}, longer ones by the weights dequantized"
            )
        assert ql.describe([weight], dtype).endswith(routes)


def _q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M mix, as it falls on the tiny model (llama-quantize on SmolLM2 writes
    the same kinds): Q4_K, v and down in Q6_K, the embedding in Q8_0, layer 1's gate and up in
    Q5_0 (llama.cpp's fallback for rows that are no multiple of 256); and layer 1's k in a type
    the kernels do not keep (F32 here, Q3_K in a Q3_K_M file), which leaves its q/k/v dense."""
    if "v_proj" in name or "down_proj" in name:
        return Q.Q6_K
    if "embed_tokens" in name:
        return Q.Q8_0
    if "layers.1." in name and "k_proj" in name:
        return Q.F32
    if "layers.1." in name and ("gate_proj" in name or "up_proj" in name):
        return Q.Q5_0
    return Q.Q4_K


@needs_block_dot
def test_a_q4_k_m_model_keeps_its_k_quants_and_mixed_fused_weights(tmp_path, caplog):
    """Rows of 256 values (K-quants need whole super-blocks)."""
    config, weights = _tiny_llama(tmp_path, hidden=256, initializer_range=0.15)
    path = write_gguf_like_llama_cpp(
        tmp_path / "tiny.Q4_K_M.gguf", config, weights, tensor_type=_q4_k_m
    )
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        kept, _ = _kept_and_dense(path, "float32")
    layers = kept.engine.core.worker.model.layers
    kinds = [
        [quantized(p) and quantized(p).kinds
         for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)]
        for layer in layers
    ]  # fmt: skip
    assert kinds == [
        [["Q4_K", "Q6_K"], ["Q4_K"], ["Q4_K"], ["Q6_K"]],
        [None, ["Q4_K"], ["Q5_0"], ["Q6_K"]],
    ]
    assert "blocks (4 Q4_K, 1 Q5_0, 3 Q6_K, 1 Q8_0)" in caplog.text


@needs_block_dot
def test_the_real_q4_1_file_keeps_its_blocks(caplog):
    """The embedded SmolLM2 Q4_1 file: 210 Q4_1 weights (q/k/v, o, gate/up, down of 30 layers,
    stacked into 120) and the Q8_0 tied embedding, kept at the file's size; greedy text close to
    the dequantized model's (their measured agreement is in BENCHMARKS.md)."""
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        kept = LLM(
            "smollm2-135m-instruct", dtype="float32", quantization="gguf", max_model_len=256,
            kv_cache_memory=1 << 26,
        )  # fmt: skip
    assert (
        "quantized matmul weights kept as the GGUF file's blocks (120 Q4_1, 1 Q8_0): 92.0 MiB "
        "instead of 513.0 MiB in float32 (5.6x less)" in caplog.text
    )
    assert kept.engine.core.worker.num_params == 134_515_008  # the kept weights' shapes count
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=2)
    assert kept.generate([prompt], params)[0].outputs[0].text == " Paris."
