"""Quantized weights kept quantized on CPU (engine/models/quantized_linear.py,
kernels/csrc/cpu_quant.cpp): GGUF blocks parse to the values gguf dequantizes to, the int4/int8
weights hold those values (int4 up to its bfloat16 scales, int8 up to its per-row requantization),
torch's kernels and the compiled GEMM give the same products as a float64 reference on the same
values, a tiny Llama GGUF runs through the engine with its matmul weights kept quantized and scores
its tokens as the dense model of the same values does, and the real SmolLM2 Q4_1 file keeps 2.8x
fewer weight bytes.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

import pagedserve.engine.models.quantized_linear as ql
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.cpu_linear import pack
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.quantized_linear import (
    Int4Weight,
    Int8Weight,
    QuantizedRows,
    QuantizedWeight,
    gguf_rows,
    keep_quantized,
    quantized,
)
from pagedserve.kernels import cpu_features
from tests.gguf_writer import write_gguf_like_llama_cpp

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_gemm = pytest.mark.skipif(
    not ql.compiled_gemm(),
    reason="the compiled GEMM needs a C++ compiler and level avx512_bf16: this CPU/level has "
    f"{cpu_features.cpu_features().level}",
)


def _file_weight(qtype: Q, n: int = 128, k: int = 96, seed: int = 0):
    """A random [n, k] weight quantized by gguf: (its blocks, gguf's dequantized values)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[3, :40] *= 20  # a row with an outlier region: per-row int8 scales differ from per-group
    data = gguf.quants.quantize(w, qtype)
    return data, torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k).copy())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_parse_to_the_values_gguf_dequantizes_to(qtype):
    data, values = _file_weight(qtype)
    rows = gguf_rows(data, qtype, (128, 96))
    assert rows.kind == ("int8" if qtype == Q.Q8_0 else "int4")
    assert rows.codes.shape == (128, 96) and rows.scales.shape == (128, 3)
    if rows.kind == "int4":
        assert int(rows.codes.min()) >= 0 and int(rows.codes.max()) <= 15
    assert torch.equal(rows.dequantize(), values)


def test_unsupported_blocks_and_shapes_are_refused():
    data, _ = _file_weight(Q.Q5_0)
    with pytest.raises(ValueError, match="Q5_0 weights are not kept quantized"):
        gguf_rows(data, Q.Q5_0, (128, 96))
    with pytest.raises(ValueError, match="K divisible by 32"):
        gguf_rows(np.zeros(10, np.uint8), Q.Q8_0, (2, 40))
    rows = gguf_rows(_file_weight(Q.Q4_1, n=96)[0], Q.Q4_1, (96, 96))
    assert not QuantizedWeight.supports(rows)
    with pytest.raises(ValueError, match="divisible by 64, got \\(96, 96\\)"):
        QuantizedWeight.build(rows)
    with pytest.raises(ValueError, match="cannot stack quantized rows of kinds"):
        QuantizedRows.cat([rows, gguf_rows(_file_weight(Q.Q8_0)[0], Q.Q8_0, (128, 96))])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_weights_hold_the_file_values_up_to_bfloat16_scales(qtype):
    data, values = _file_weight(qtype)
    rows = gguf_rows(data, qtype, (128, 96))
    weight = Int4Weight(rows)
    # torch's formula on the stored (bfloat16) scale and zero, rounded once to bfloat16.
    scale = rows.scales.bfloat16().float().repeat_interleave(32, 1)
    offsets = rows.offsets.repeat_interleave(32, 1)
    zero = (offsets + 8.0 * rows.scales.repeat_interleave(32, 1)).bfloat16().float()
    expected = ((rows.codes.float() - 8.0) * scale + zero).bfloat16()
    torch.testing.assert_close(weight.dequantize(), expected, rtol=2**-8, atol=1e-7)
    # Against the file: float16 -> bfloat16 rounding of scale and zero, then of the value.
    step = rows.scales.abs().max().item()
    assert (weight.dequantize().float() - values).abs().max().item() < 0.02 * step * 8
    assert weight.nbytes == 128 * 96 // 2 + 3 * 128 * 2 * 2


def test_int8_weights_are_the_file_values_requantized_per_row():
    data, values = _file_weight(Q.Q8_0)
    weight = Int8Weight(gguf_rows(data, Q.Q8_0, (128, 96)))
    scales = weight.scales.float()
    assert torch.equal(scales, (values.abs().amax(1) / 127).bfloat16().float())
    error = (weight.codes.float() * scales.unsqueeze(1) - values).abs()
    assert bool((error <= scales.unsqueeze(1) / 2 * (1 + 2**-7)).all())
    assert weight.codes.abs().max().item() == 127  # each row's largest value is a full code
    assert weight.nbytes == 128 * 96 + 128 * 2
    ids = torch.tensor([3, 0, 127, 3])
    assert torch.equal(weight.embedding(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 13, 33, 64, 200])
def test_linear_equals_a_float64_product_on_the_kept_values(qtype, rows):
    data, _ = _file_weight(qtype, n=192, k=128, seed=rows)
    weight = QuantizedWeight.build(gguf_rows(data, qtype, (192, 128)))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(192).bfloat16()
    reference = x.double() @ weight.dequantize().double().T + bias.double()
    out = weight.linear(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 192)
    # bfloat16 outputs: within a few roundings of the largest output.
    tolerance = reference.abs().max().item() * 2**-7
    torch.testing.assert_close(out.double(), reference, rtol=2**-7, atol=tolerance)


@needs_gemm
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 6, 7, 40])
def test_compiled_gemm_agrees_with_torchs_kernel(qtype, rows):
    data, _ = _file_weight(qtype, n=256, k=160, seed=7)
    weight = QuantizedWeight.build(gguf_rows(data, qtype, (256, 160)))
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch.empty(rows, 256, dtype=torch.bfloat16)
    weight._gemm(x, out)
    expected = weight._int_matmul(x)
    tolerance = expected.abs().max().item() * 2**-7
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=tolerance)


@needs_gemm
def test_rows_above_the_int_kernels_limit_go_to_the_compiled_gemm(monkeypatch):
    data, _ = _file_weight(Q.Q4_1)
    weight = Int4Weight(gguf_rows(data, Q.Q4_1, (128, 96)))
    calls = []
    monkeypatch.setattr(Int4Weight, "_gemm", lambda self, x, out: calls.append(("gemm", len(x))))
    real_int = Int4Weight._int_matmul
    monkeypatch.setattr(
        Int4Weight,
        "_int_matmul",
        lambda self, x: calls.append(("int", len(x))) or real_int(self, x),
    )
    for rows in (1, Int4Weight.int_kernel_max_rows, Int4Weight.int_kernel_max_rows + 1):
        weight.linear(torch.zeros(rows, 96, dtype=torch.bfloat16))
    assert calls == [("int", 1), ("int", 8), ("gemm", 9)]


def test_without_the_compiled_gemm_torchs_kernel_takes_every_step(monkeypatch):
    monkeypatch.setattr(ql, "compiled_gemm", lambda: False)
    data, _ = _file_weight(Q.Q8_0)
    weight = Int8Weight(gguf_rows(data, Q.Q8_0, (128, 96)))
    x = torch.randn(50, 96).bfloat16()
    assert torch.equal(weight.linear(x), weight._int_matmul(x))
    assert not keep_quantized("auto", "gguf", CPU, torch.bfloat16, sharded=False)
    assert keep_quantized("gguf", "gguf", CPU, torch.bfloat16, sharded=False)


def test_float32_activations_are_refused():
    weight = Int8Weight(gguf_rows(_file_weight(Q.Q8_0)[0], Q.Q8_0, (128, 96)))
    with pytest.raises(ValueError, match="multiply bfloat16 activations, got torch.float32"):
        weight.linear(torch.zeros(1, 96))


@pytest.mark.parametrize(
    "quantization, kind, device, dtype, sharded, expected",
    [
        ("none", "gguf", "cpu", torch.bfloat16, False, False),
        ("auto", "gguf", "cpu", torch.float32, False, False),
        ("auto", "hf_dir", "cpu", torch.bfloat16, False, False),
        ("auto", "gguf", "cuda", torch.bfloat16, False, False),
        ("auto", "gguf", "cpu", torch.bfloat16, True, False),
        ("gguf", "gguf", "cpu", torch.bfloat16, False, True),
    ],
)
def test_when_weights_are_kept_quantized(quantization, kind, device, dtype, sharded, expected):
    assert keep_quantized(quantization, kind, torch.device(device), dtype, sharded) is expected


@needs_gemm
def test_auto_keeps_a_gguf_file_quantized_in_bfloat16_on_cpu():
    assert keep_quantized("auto", "gguf", CPU, torch.bfloat16, sharded=False)


def test_gguf_where_it_cannot_apply_says_what_to_change():
    with pytest.raises(ValueError) as info:
        keep_quantized("gguf", "hf_dir", torch.device("cuda"), torch.float32, sharded=True)
    assert str(info.value) == (
        "--quantization gguf cannot keep the weights quantized: the model is not a GGUF file; "
        "quantized matmuls run on CPU, the device is cuda; they multiply bfloat16 activations, "
        "the dtype is torch.float32; tensor parallelism slices dequantized weights (use "
        "--quantization none, or auto to decide per run)"
    )
    with pytest.raises(ValueError, match="quantization must be one of"):
        keep_quantized("awq", "gguf", CPU, torch.bfloat16, sharded=False)


# ---- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny tied-embedding Llama whose matmul weights have 64-multiple output features, and
    its GGUF files in Q4_1 and Q8_0 (q/k rows permuted as llama.cpp writes them)."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    mc = ModelConfig.from_json_file(folder / "config.json")
    return {
        qtype.name: write_gguf_like_llama_cpp(
            folder / f"tiny.{qtype.name}.gguf", mc, hf.state_dict(), tensor_type=qtype
        )
        for qtype in (Q.Q4_1, Q.Q8_0)
    }


def _llm(path, quantization: str) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="bfloat16", quantization=quantization, num_kv_blocks=64,
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


# Prompts of 1 to 30 tokens, run together: one step holds decode rows and prefill rows, so both
# the int kernels (few rows) and the compiled GEMM (many) multiply.
PROMPTS = [[5], [7, 8, 9, 10, 11], list(range(20, 33)), list(range(40, 70))]


@pytest.mark.parametrize("qtype, embedding_kind", [("Q4_1", None), ("Q8_0", "int8")])
def test_a_gguf_model_runs_with_its_matmul_weights_kept_quantized(
    tiny_llama, qtype, embedding_kind, caplog
):
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        kept = _llm(tiny_llama[qtype], "gguf")
    model = kept.engine.core.worker.model
    for layer in model.layers:
        for param in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):  # fmt: skip
            assert quantized(param) is not None and param.numel() == 0
            assert quantized(param).kind == ("int8" if qtype == "Q8_0" else "int4")
    qkv = quantized(model.layers[0].self_attn.qkv_proj)
    assert (qkv.out_features, qkv.in_features) == (128, 64)
    # A tied embedding is also the lm_head: kept in int8 (lookups read its rows), dense in int4.
    embedding = quantized(model.embed_tokens)
    assert (embedding.kind if embedding else None) == embedding_kind
    assert model.embed_tokens.numel() == (0 if embedding_kind else 256 * 64)
    assert "quantized matmul weights kept quantized (" in caplog.text
    dense = _llm(tiny_llama[qtype], "none")
    dense_weights = dense.engine.core.worker.model.matmul_weights()
    assert all(quantized(p) is None for p in dense_weights)
    # The dequantized model with the kept weights' own values (int8 rows are requantized, int4
    # scales rounded to bfloat16), through oneDNN (packed where the CPU lets it pack bf16, else
    # F.linear, as the engine does there): each token of its greedy continuations is as
    # likely under the kept weights. int4 through the compiled GEMM (the prompt-logprob steps are
    # many rows): the same bfloat16 weights and float32 sums, so the same numbers (measured:
    # equal). int4 through torch's int4 kernel (CPU levels without the compiled GEMM: avx2,
    # avx512) and int8: their products round apart from the dense ones (int8: the kernels
    # multiply by code * scale exactly, the dense copy holds it rounded to bfloat16); measured
    # under the avx512_bf16, avx512 and avx2 levels: 0.16-0.21 apart at most, 0.04 on average.
    # A weight in the wrong place would move them by nats. (Greedy tokens alone are no test:
    # sums moved by bfloat16 rounding flip near-ties.)
    for param, kept_param in zip(dense_weights, model.matmul_weights(), strict=True):
        if quantized(kept_param) is not None:
            param.data.copy_(quantized(kept_param).dequantize())
            pack(param)
    sequences = [p + t for p, t in zip(PROMPTS, _greedy(dense, PROMPTS), strict=True)]
    expected, got = _token_logprobs(dense, sequences), _token_logprobs(kept, sequences)
    assert len(got) == sum(len(s) - 1 for s in sequences) and min(expected) < -1.0
    differences = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    if qtype == "Q4_1" and ql.compiled_gemm():
        assert max(differences) < 1e-3
    else:
        assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.08


def test_the_real_q4_1_file_keeps_its_weights_in_int4_and_int8(caplog):
    """The embedded SmolLM2 Q4_1 file: 210 int4 weights (q/k/v, o, gate/up, down of 30 layers,
    stacked into 120) and the Q8_0 tied embedding in int8; greedy text close to the dequantized
    model's (their measured agreement is in BENCHMARKS.md)."""
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        kept = LLM(
            "smollm2-135m-instruct", dtype="bfloat16", quantization="gguf", max_model_len=256
        )
    assert (
        "quantized matmul weights kept quantized (120 int4, 1 int8): 90.4 MiB instead of "
        "256.5 MiB in bfloat16 (2.8x less)" in caplog.text
    )
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=2)
    assert kept.generate([prompt], params)[0].outputs[0].text == " Paris."
