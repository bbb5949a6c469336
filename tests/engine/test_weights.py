"""Weight iterators: GGUF (tiny files written here, and the real SmolLM2), safetensors, dummy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedserve.engine.models.gguf_config import config_from_gguf
from pagedserve.engine.models.hf_config import hf_dict_of
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import GGUFFile, embedded_model_path, resolve_model
from pagedserve.engine.models.weights import (
    dummy_weights,
    iter_gguf_weights,
    iter_safetensors_weights,
    load_weights,
    permute_qk,
    unpermute_qk,
)
from tests.gguf_writer import llama_cpp_permute, write_gguf_like_llama_cpp
from tests.helpers import tiny_config


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in config.weight_shapes().items()}


# ---------------------------------------------------------------------- GGUF, tiny files


@pytest.mark.parametrize("arch, permuted", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_tiny_gguf_round_trips_to_the_hf_tensors(tmp_path: Path, arch: str, permuted: bool):
    config = tiny_config(arch, qk_norm=arch == "qwen3")
    hf = random_hf_weights(config)
    path = write_gguf_like_llama_cpp(tmp_path / "tiny.gguf", config, hf)

    reader = gguf.GGUFReader(path)
    # GGUF lists dims innermost first: q_proj [out=32, in=32] is fine, k_proj [16, 32] is not.
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    assert shapes["blk.0.attn_k.weight"] == [32, 16]
    if permuted:  # the permutation really moved rows, so undoing it is under test
        q = np.asarray(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data)
        assert not np.array_equal(q, hf["model.layers.0.self_attn.q_proj.weight"].numpy())

    loaded = list(iter_gguf_weights(path, config, progress=False))
    assert [name for name, _ in loaded] == list(hf)  # HF order, nothing extra
    for name, tensor in loaded:
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, hf[name]), name
    # The config read back from the file is the one that wrote it (bar the dtype note).
    assert config_from_gguf(reader) == config


def test_unpermute_inverts_the_converter_for_weights_and_biases():
    w = torch.arange(48 * 5, dtype=torch.float32).reshape(48, 5)
    b = torch.arange(48, dtype=torch.float32)
    for heads in (1, 3, 6):
        for t in (w, b):
            permuted = llama_cpp_permute(t, heads, None).numpy()
            assert np.array_equal(unpermute_qk(permuted, heads), t.numpy())
            assert np.array_equal(permute_qk(t.numpy(), heads), permuted)
    # Head 0 of size 8: HF rows [x0 x1 x2 x3 y0 y1 y2 y3] are stored as pairs [x0 y0 x1 y1 ...].
    assert llama_cpp_permute(b, 6, None)[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="cannot unpermute shape \\(48,\\) into 5 heads"):
        unpermute_qk(b.numpy(), 5)


def test_gguf_that_does_not_fit_the_config_is_rejected(tmp_path: Path):
    config = tiny_config()
    path = write_gguf_like_llama_cpp(tmp_path / "t.gguf", config, random_hf_weights(config))
    wrong_vocab = dataclasses.replace(config, vocab_size=65)
    with pytest.raises(ValueError, match="token_embd.weight' has shape \\(64, 32\\), config "):
        list(iter_gguf_weights(path, wrong_vocab, progress=False))
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="'output.weight' \\(lm_head.weight\\) does not belong"):
        list(iter_gguf_weights(path, tied, progress=False))


# ---------------------------------------------------------------------- GGUF, the real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    path = embedded_model_path("smollm2-135m-instruct")
    reader = gguf.GGUFReader(path)
    return path, reader, config_from_gguf(reader)


def test_real_smollm2_yields_the_hf_names_and_shapes(smollm2):
    _, reader, config = smollm2
    shapes = {name: tuple(t.shape) for name, t in iter_gguf_weights(reader, config, progress=False)}
    assert len(shapes) == 272
    assert shapes == config.weight_shapes()
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)


def test_real_smollm2_equals_transformers_gguf_loader(smollm2):
    """Every tensor equals what transformers' GGUF loader makes of it: gguf-py's HF -> GGUF name
    map and transformers' LlamaTensorProcessor (dequantize, then undo the q/k permutation), the
    steps from_pretrained(gguf_file=...) takes per tensor. (Calling load_gguf_checkpoint itself
    costs ~10 s, most of it rebuilding the name map per submodule.)"""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, reader, config = smollm2
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    processor = LlamaTensorProcessor(config=hf_dict_of(config))
    tensors = {t.name: t for t in reader.tensors}
    for name, tensor in iter_gguf_weights(reader, config, progress=False):
        module, suffix = name.rsplit(".", 1)
        gguf_tensor = tensors.pop(f"{name_map.get_name(module)}.{suffix}")
        weights = gguf.dequantize(gguf_tensor.data, gguf_tensor.tensor_type)
        expected = processor.process(weights=weights, name=gguf_tensor.name).weights
        assert torch.equal(tensor, torch.from_numpy(np.copy(expected))), name
    assert not tensors


@pytest.mark.slow
def test_real_smollm2_equals_the_transformers_model_state_dict(smollm2, hf_smollm2):
    """The same check against the state dict of AutoModelForCausalLM(gguf_file=...) (~20 s to
    load, shared with the real-model tests through the session fixture)."""
    _, reader, config = smollm2
    state = hf_smollm2[0].state_dict()
    for name, tensor in iter_gguf_weights(reader, config, progress=False):
        assert torch.equal(tensor, state[name]), name


# ---------------------------------------------------------------------- safetensors


def test_safetensors_shards_round_trip(tmp_path: Path):
    config = tiny_config()
    hf = random_hf_weights(config)
    names = list(hf)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: hf[k].to(torch.bfloat16) for k in keys}, tmp_path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Mistral repos also ship their own format; it must not be read.
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")

    loaded = dict(iter_safetensors_weights(tmp_path, progress=False))
    assert sorted(loaded) == sorted(hf)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, hf[name].to(torch.bfloat16)), name
    as_fp32 = dict(iter_safetensors_weights(tmp_path, dtype=torch.float32, progress=False))
    assert as_fp32["model.norm.weight"].dtype == torch.float32


def test_safetensors_without_index_skips_consolidated_and_inv_freq(tmp_path: Path):
    save_file(
        {
            "model.norm.weight": torch.ones(4),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
        },
        tmp_path / "model.safetensors",
    )
    save_file({"norm.weight": torch.ones(4)}, tmp_path / "consolidated.safetensors")
    assert list(dict(iter_safetensors_weights(tmp_path, progress=False))) == ["model.norm.weight"]
    with pytest.raises(ValueError, match="no \\*.safetensors files in"):
        list(iter_safetensors_weights(tmp_path / "empty", progress=False))


# ---------------------------------------------------------------------- dummy


def test_dummy_weights_are_deterministic_and_shaped_by_the_config():
    config = tiny_config("qwen2")
    a = list(dummy_weights(config, torch.float32, seed=3))
    b = list(dummy_weights(config, torch.float32, seed=3))
    c = dict(dummy_weights(config, torch.float32, seed=4))
    assert [n for n, _ in a] == list(config.weight_shapes())
    assert {n: tuple(t.shape) for n, t in a} == config.weight_shapes()
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), name
        if name.endswith("norm.weight"):
            assert torch.equal(x, torch.ones_like(x))
        else:
            assert not torch.equal(x, c[name]), name
    embed = dict(a)["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    bf16 = dict(dummy_weights(config, torch.bfloat16, seed=3))
    assert bf16["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert torch.equal(bf16["model.embed_tokens.weight"], embed.to(torch.bfloat16))


# ---------------------------------------------------------------------- load_weights


def test_load_weights_dispatches_on_the_source(tmp_path: Path):
    config = tiny_config()
    hf = random_hf_weights(config)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hf_dict_of(config)))
    save_file(hf, hf_dir / "model.safetensors")
    gguf_path = write_gguf_like_llama_cpp(tmp_path / "tiny.gguf", config, hf)

    hf_source, gguf_source = resolve_model(str(hf_dir)), resolve_model(str(gguf_path))
    for source in (hf_source, gguf_source):
        loaded = dict(load_weights(source, progress=False))
        assert loaded.keys() == hf.keys()
        assert all(torch.equal(loaded[k], hf[k]) for k in hf), source.kind
        dummy = dict(load_weights(source, "dummy"))
        assert torch.equal(dummy["lm_head.weight"], dict(dummy_weights(config))["lm_head.weight"])
    gguf_bf16 = dict(load_weights(gguf_source, "gguf", dtype=torch.bfloat16, progress=False))
    assert gguf_bf16["model.norm.weight"].dtype == torch.bfloat16

    shape_source = resolve_model("smollm2-135m")
    assert shape_source.kind == "dummy"
    first_name, first = next(iter(load_weights(shape_source)))
    assert (first_name, tuple(first.shape)) == ("model.embed_tokens.weight", (49152, 576))

    with pytest.raises(ValueError, match="'safetensors' needs a Hugging Face folder"):
        load_weights(gguf_source, "safetensors")
    with pytest.raises(ValueError, match="'gguf' needs a .gguf file, but model 'smollm2-135m'"):
        load_weights(shape_source, "gguf")
    with pytest.raises(ValueError, match="unknown load format 'pt'"):
        load_weights(hf_source, "pt")


def test_gguf_file_parses_the_fields_gguf_reader_does(tmp_path):
    # GGUFFile reads arrays of scalars and strings in one pass; what it yields must be
    # GGUFReader's, part for part: transformers' GGUF loaders read the parts and indices.
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "fields")
    writer.add_uint32("llama.block_count", 3)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "é", "▁the", "\n", "x" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0, -0.5, 1.0])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 6, 1])
    writer.add_array("tokenizer.ggml.merges", ["▁ t", "h e"])
    writer.add_array("flags", [True, False])
    writer.add_tensor("weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert [(p.dtype, p.shape, p.tobytes()) for p in got.parts] == [
            (p.dtype, p.shape, p.tobytes()) for p in want.parts
        ], name
        assert got.contents() == want.contents(), name
    assert ours.fields["tokenizer.ggml.tokens"].contents()[2] == "é"
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
