"""`load_adapter` against PEFT itself: random adapters saved by PEFT around tiny transformers
models load to exactly PEFT's tensors in pagedserve's per-projection layout (scaling folded
into B), the layout computes what PEFT's merged modules compute, the same adapter written as
llama.cpp's converter writes a LoRA GGUF loads to the same weights, and every adapter the layout
cannot serve, or the base model does not fit, is refused with a message that says so.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file

from pagedserve.engine.lora.adapter import PROJECTIONS, LoRAAdapter, load_adapter
from pagedserve.engine.models.hf_config import config_from_hf_dict, config_from_json_file
from pagedserve.engine.models.model_config import ModelConfig
from tests.families import build_family
from tests.lora_adapters import (
    ALL_TARGETS,
    PHI3_TARGETS,
    WEIGHTS_FILE,
    gguf_lora_tensors,
    peft_pair,
    peft_tensors,
    save_random_peft_adapter,
    write_gguf_lora,
    write_gguf_lora_tensors,
)

TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
# projection -> its parts' modules (a Llama's names).
PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
MAX_RANK = 64


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, ModelConfig]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    return model, config_from_hf_dict(model.config.to_dict())


@pytest.fixture(scope="module")
def adapter_dir(llama, tmp_path_factory) -> Path:
    """An r=8, alpha=16 adapter on all seven modules of the tiny Llama."""
    path = tmp_path_factory.mktemp("lora") / "all"
    return save_random_peft_adapter(llama[0], path, 8, 16, ALL_TARGETS, seed=1)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[torch.nn.Module, ModelConfig, Path]:
    """A tiny Phi-3 (fused qkv_proj and gate_up_proj), its config and an adapter on all four."""
    base = tmp_path_factory.mktemp("phi3")
    model = build_family("phi3", base / "model")
    config = config_from_json_file(base / "model" / "config.json")
    adapter = save_random_peft_adapter(model, base / "lora", 4, 8, PHI3_TARGETS, seed=2)
    return model, config, adapter


def _load(path: Path, config: ModelConfig, max_rank: int = MAX_RANK) -> LoRAAdapter:
    return load_adapter(path, config, max_rank, "test-lora")


def _expected_llama(folder: Path, config: ModelConfig, scale: float) -> list[dict[str, tuple]]:
    """Per layer, projection -> (a, b) built from PEFT's tensors by hand (missing: zeros)."""
    tensors = peft_tensors(folder)
    r = next(t.shape[0] for k, t in tensors.items() if "lora_A" in k)
    layers = []
    for layer in range(config.num_hidden_layers):
        projections = {}
        for projection, modules in PARTS.items():
            if not any(_has(tensors, layer, m) for m in modules):
                continue
            a, b = [], []
            for module, size in zip(modules, _out_sizes(config, projection), strict=True):
                if _has(tensors, layer, module):
                    lora_a, lora_b = peft_pair(tensors, layer, module)
                    a.append(lora_a)
                    b.append(lora_b * scale)
                else:
                    a.append(torch.zeros(r, _in_size(config, projection)))
                    b.append(torch.zeros(size, r))
            projections[projection] = (torch.stack(a), torch.cat(b))
        layers.append(projections)
    return layers


def _in_size(config: ModelConfig, projection: str) -> int:
    q = config.num_attention_heads * config.head_dim
    return {"qkv": config.hidden_size, "o": q, "gate_up": config.hidden_size,
            "down": config.intermediate_size}[projection]  # fmt: skip


def _has(tensors: dict, layer: int, module: str) -> bool:
    return f"base_model.model.model.layers.{layer}.{module}.lora_A.weight" in tensors


def _out_sizes(config: ModelConfig, projection: str) -> tuple[int, ...]:
    q, kv = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    h, inter = config.hidden_size, config.intermediate_size
    return {"qkv": (q, kv, kv), "o": (h,), "gate_up": (inter, inter), "down": (h,)}[projection]


def _assert_layers_equal(adapter: LoRAAdapter, expected: list[dict[str, tuple]]) -> None:
    assert len(adapter.layers) == len(expected)
    for got, want in zip(adapter.layers, expected, strict=True):
        assert set(got) == set(want)
        for projection, (a, b) in want.items():
            assert got[projection].a.dtype == got[projection].b.dtype == torch.float32
            assert got[projection].a.device.type == "cpu"
            torch.testing.assert_close(got[projection].a, a, rtol=0, atol=0)
            torch.testing.assert_close(got[projection].b, b, rtol=0, atol=0)


# ------------------------------------------------------------------ PEFT folders


def test_a_peft_folder_loads_to_peft_tensors_with_the_scaling_in_b(llama, adapter_dir):
    adapter = _load(adapter_dir, llama[1])
    assert (adapter.name, adapter.rank) == ("test-lora", 8)
    assert adapter.target_modules == tuple(sorted(ALL_TARGETS))
    _assert_layers_equal(adapter, _expected_llama(adapter_dir, llama[1], scale=16 / 8))
    assert all(set(layer) == set(PROJECTIONS) for layer in adapter.layers)


def test_rslora_scales_by_alpha_over_the_square_root_of_r(llama, tmp_path):
    folder = save_random_peft_adapter(llama[0], tmp_path, 4, 6, ALL_TARGETS, 3, use_rslora=True)
    adapter = _load(folder, llama[1])
    _assert_layers_equal(adapter, _expected_llama(folder, llama[1], scale=6 / math.sqrt(4)))


def test_untargeted_parts_are_zero_and_untargeted_projections_absent(llama, tmp_path):
    folder = save_random_peft_adapter(llama[0], tmp_path, 8, 16, ["q_proj", "v_proj"], seed=4)
    adapter = _load(folder, llama[1])
    assert adapter.target_modules == ("q_proj", "v_proj")
    _assert_layers_equal(adapter, _expected_llama(folder, llama[1], scale=2.0))
    qkv = adapter.layers[0]["qkv"]
    q, kv = _out_sizes(llama[1], "qkv")[:2]
    assert not qkv.a[1].any() and not qkv.b[q : q + kv].any()
    assert qkv.a[0].any() and qkv.a[2].any()
    assert all(set(layer) == {"qkv"} for layer in adapter.layers)


def test_layers_to_transform_leaves_the_other_layers_empty(llama, tmp_path):
    folder = save_random_peft_adapter(
        llama[0], tmp_path, 8, 16, ALL_TARGETS, seed=5, layers_to_transform=[1]
    )
    adapter = _load(folder, llama[1])
    assert adapter.layers[0] == {} and set(adapter.layers[1]) == set(PROJECTIONS)
    _assert_layers_equal(adapter, _expected_llama(folder, llama[1], scale=2.0))


def test_a_pickled_adapter_model_bin_is_refused_unread(llama, adapter_dir, tmp_path):
    folder = _copy(adapter_dir, tmp_path)
    (folder / "adapter_model.bin").write_bytes(b"not even a pickle: it must not be opened")
    (folder / WEIGHTS_FILE).unlink()
    with pytest.raises(ValueError, match=r"its weights are a pickle \(adapter_model.bin\)"):
        _load(folder, llama[1])


def test_phi3_fused_modules_give_every_part_the_same_a_and_split_b(phi3):
    _, config, folder = phi3
    adapter = _load(folder, config)
    assert adapter.target_modules == tuple(sorted(PHI3_TARGETS))
    tensors = peft_tensors(folder)
    modules = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
               "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}  # fmt: skip
    for i, layer in enumerate(adapter.layers):
        assert set(layer) == set(PROJECTIONS)
        for projection, module in modules.items():
            a, b = peft_pair(tensors, i, module)
            for part in layer[projection].a:
                assert torch.equal(part, a)
            assert torch.equal(layer[projection].b, b * (8 / 4))


def test_the_layout_computes_what_peft_computes(llama, adapter_dir):
    model, config = llama
    from peft import PeftModel

    peft = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).eval()
    attn = peft.base_model.model.model.layers[0].self_attn
    lora = _load(adapter_dir, config).layers[0]
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        base = torch.cat([attn.q_proj.base_layer(x), attn.k_proj.base_layer(x),
                          attn.v_proj.base_layer(x)], dim=-1)  # fmt: skip
    torch.testing.assert_close(base + _delta(lora["qkv"], config, x), peft_qkv)
    # The merged weights differ from the base by exactly the layout's B_j @ A_j per part.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = dict(peft.merge_and_unload().named_parameters())
    for projection, modules in PARTS.items():
        delta = torch.cat([
            merged[f"model.layers.0.{m}.weight"] - before[f"model.layers.0.{m}.weight"]
            for m in modules
        ])  # fmt: skip
        torch.testing.assert_close(_weight_delta(lora[projection], config, projection), delta)


def _delta(weights, config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """x's LoRA delta from the layout: part j's rows of B times A_j x."""
    out, start = [], 0
    for j, size in enumerate(_out_sizes(config, "qkv")):
        out.append(x @ weights.a[j].T @ weights.b[start : start + size].T)
        start += size
    return torch.cat(out, dim=-1)


def _weight_delta(weights, config: ModelConfig, projection: str) -> torch.Tensor:
    rows, start = [], 0
    for j, size in enumerate(_out_sizes(config, projection)):
        rows.append(weights.b[start : start + size] @ weights.a[j])
        start += size
    return torch.cat(rows)


# ------------------------------------------------------------------ GGUF files


@pytest.mark.parametrize(
    "tensor_type, tolerance",
    [("F32", 0.0), ("F16", 2e-3), ("BF16", 1e-2)],
)
def test_a_gguf_lora_loads_like_the_peft_folder_it_came_from(
    llama, adapter_dir, tmp_path, tensor_type, tolerance
):
    config = llama[1]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    path = write_gguf_lora(tmp_path / "lora.gguf", config, adapter_dir, qtype)
    # The converter's permutation really moved q's rows (else this test would not test it).
    stored = gguf_lora_tensors(config, adapter_dir)["blk.0.attn_q.weight.lora_b"]
    assert not torch.equal(torch.from_numpy(stored), peft_pair(peft_tensors(adapter_dir), 0,
                                                               "self_attn.q_proj")[1])  # fmt: skip
    from_gguf, from_peft = _load(path, config), _load(adapter_dir, config)
    assert (from_gguf.rank, from_gguf.target_modules) == (from_peft.rank, from_peft.target_modules)
    for got, want in zip(from_gguf.layers, from_peft.layers, strict=True):
        assert set(got) == set(want)
        for projection in want:
            for field in ("a", "b"):
                g, w = getattr(got[projection], field), getattr(want[projection], field)
                assert g.dtype == torch.float32
                torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * w.abs().max())


def test_a_phi3_gguf_lora_loads_like_its_peft_folder(phi3, tmp_path):
    _, config, folder = phi3
    from_gguf = _load(write_gguf_lora(tmp_path / "lora.gguf", config, folder), config)
    from_peft = _load(folder, config)
    for got, want in zip(from_gguf.layers, from_peft.layers, strict=True):
        for projection in want:
            assert torch.equal(got[projection].a, want[projection].a)
            assert torch.equal(got[projection].b, want[projection].b)


# ------------------------------------------------------------------ refusals


def _copy(adapter_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter_dir, tmp_path / "copy"))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_weights(folder: Path, rename: tuple[str, str] | None = None, add: dict | None = None):
    tensors = peft_tensors(folder)
    if rename is not None:
        tensors = {k.replace(*rename): v for k, v in tensors.items()}
    save_file({**tensors, **(add or {})}, folder / WEIGHTS_FILE)


def test_a_missing_path_or_incomplete_folder_is_refused(llama, adapter_dir, tmp_path):
    config = llama[1]
    with pytest.raises(ValueError, match=r"LoRA adapter 'test-lora' at .*nope.*no such file"):
        _load(tmp_path / "nope", config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        _load(tmp_path / "empty", config)
    shutil.copy(adapter_dir / "adapter_config.json", tmp_path / "empty")
    with pytest.raises(ValueError, match=r"has no weights \(adapter_model.safetensors\)"):
        _load(tmp_path / "empty", config)


def test_a_rank_over_max_lora_rank_is_refused(llama, adapter_dir, tmp_path):
    message = "rank 8 exceeds --max-lora-rank 4; restart the server with --max-lora-rank 8 or more"
    with pytest.raises(ValueError, match=message):
        _load(adapter_dir, llama[1], max_rank=4)
    path = write_gguf_lora(tmp_path / "lora.gguf", llama[1], adapter_dir)
    with pytest.raises(ValueError, match=message):
        _load(path, llama[1], max_rank=4)


EMBEDDING = "adapters that add tokens or change embeddings are not supported"
UNSUPPORTED = {
    "modules_to_save": (dict(modules_to_save=["lm_head", "embed_tokens"]), EMBEDDING),
    "trainable tokens": (dict(trainable_token_indices=[5, 6]), EMBEDDING),
    "embedding target": (dict(target_modules=["q_proj", "embed_tokens"]), EMBEDDING),
    "DoRA": (dict(use_dora=True), r"DoRA \(use_dora\)"),
    "bias": (dict(bias="lora_only"), "trained biases"),
    "fan_in_fan_out": (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    "rank_pattern": (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    "alpha_pattern": (dict(alpha_pattern={"q_proj": 4}), "alpha_pattern"),
    "not LoRA": (dict(peft_type="IA3"), "only LoRA adapters are supported"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_adapter_configs_beyond_plain_lora_are_refused(llama, adapter_dir, tmp_path, case):
    changes, message = UNSUPPORTED[case]
    folder = _copy(adapter_dir, tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message) as refused:
        _load(folder, llama[1])
    assert "merge_and_unload" in str(refused.value)  # what to do


def test_adapters_that_add_tokens_or_change_embeddings_are_refused(llama, adapter_dir, tmp_path):
    config = llama[1]
    for add in (
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 128)},
        {"base_model.model.lm_head.weight": torch.zeros(128, 64)},
    ):
        folder = _copy(adapter_dir, tmp_path)
        _edit_weights(folder, add=add)
        with pytest.raises(ValueError, match=EMBEDDING):
            _load(folder, config)
        shutil.rmtree(folder)
    folder = _copy(adapter_dir, tmp_path)
    save_file({"x": torch.zeros(1)}, folder / "new_embeddings.safetensors")
    with pytest.raises(ValueError, match="new_embeddings.safetensors"):
        _load(folder, config)
    (folder / "new_embeddings.safetensors").unlink()
    vocab = {f"t{i}": i for i in range(130)}
    tokenizer = {"model": {"type": "BPE", "vocab": vocab}, "added_tokens": [{"id": 130}]}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer has 131 tokens, more than this model's .* 128"):
        _load(folder, config)


def test_full_tensors_and_dora_magnitudes_in_the_weights_are_refused(llama, adapter_dir, tmp_path):
    stem = "base_model.model.model.layers.0"
    for key, message in (
        (f"{stem}.input_layernorm.weight", "not a LoRA A or B"),
        (f"{stem}.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ):
        folder = _copy(adapter_dir, tmp_path)
        _edit_weights(folder, add={key: torch.ones(64)})
        with pytest.raises(ValueError, match=message):
            _load(folder, llama[1])
        shutil.rmtree(folder)


@pytest.mark.parametrize(
    "rename, message",
    [
        (("self_attn.q_proj", "attn.c_attn"), "does not have: c_attn"),
        (("model.layers", "transformer.h"), r"does not have: transformer\.h\.N\.mlp\.down_proj"),
        (("mlp.gate_proj", "block_sparse_moe.experts.0.w1"), "LoRA on the experts"),
        (("mlp.gate_proj", "mlp.experts.3.gate_proj"), "LoRA on the experts"),
    ],
)
def test_modules_the_family_does_not_have_are_refused(
    llama, adapter_dir, tmp_path, rename, message
):
    folder = _copy(adapter_dir, tmp_path)
    _edit_weights(folder, rename=rename)
    with pytest.raises(ValueError, match=message):
        _load(folder, llama[1])


def test_a_llama_adapter_on_phi3_names_the_modules_phi3_lacks(phi3, adapter_dir):
    with pytest.raises(ValueError, match="phi3 model does not have: gate_proj, k_proj, q_proj"):
        _load(adapter_dir, phi3[1])


def test_a_different_base_model_is_refused(llama, adapter_dir):
    config = llama[1]
    fewer_layers = dataclasses.replace(config, num_hidden_layers=1, layer_types=())
    with pytest.raises(ValueError, match="at least 2 layers, this one has 1; serve it with the"):
        _load(adapter_dir, fewer_layers)
    narrower = dataclasses.replace(config, hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 64 vs this model's 32"):
        _load(adapter_dir, narrower)
    shorter_mlp = dataclasses.replace(config, intermediate_size=48)
    with pytest.raises(ValueError, match="intermediate size 96 vs this model's 48"):
        _load(adapter_dir, shorter_mlp)


def test_mlp_targets_on_mixture_of_experts_layers_are_refused(llama, adapter_dir, tmp_path):
    moe = dataclasses.replace(
        llama[1], architecture="mixtral", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=96,
    )  # fmt: skip
    with pytest.raises(ValueError, match="mixture-of-experts layers .* LoRA on experts"):
        _load(adapter_dir, moe)
    attention_only = save_random_peft_adapter(llama[0], tmp_path, 8, 16, ["q_proj", "o_proj"], 6)
    assert set(_load(attention_only, moe).layers[1]) == {"qkv", "o"}


def test_gguf_files_that_do_not_fit_are_refused(llama, adapter_dir, tmp_path):
    config = llama[1]
    tensors = gguf_lora_tensors(config, adapter_dir)
    a, b = tensors["blk.0.attn_q.weight.lora_a"], tensors["blk.0.attn_q.weight.lora_b"]
    cases = [
        ("qwen2", tensors, {}, "it is for a qwen2 model, this one is llama"),
        ("llama", tensors, {"general.type": "model"}, "not a LoRA adapter"),
        ("llama", {"token_embd.weight.lora_a": a, "token_embd.weight.lora_b": b}, {}, EMBEDDING),
        ("llama", {**tensors, "blk.0.attn_norm.weight": a[0]}, {}, "not a LoRA A or B"),
        ("llama", {"blk.0.ffn_gate_exps.weight.lora_a": a}, {}, "LoRA on the experts"),
        ("llama", {"blk.5.attn_q.weight.lora_a": a, "blk.5.attn_q.weight.lora_b": b}, {},
         "at least 6 layers, this one has 2"),
    ]  # fmt: skip
    for i, (arch, case_tensors, metadata, message) in enumerate(cases):
        path = write_gguf_lora_tensors(
            tmp_path / f"{i}.gguf", arch, case_tensors, 16, metadata=metadata
        )
        with pytest.raises(ValueError, match=message):
            _load(path, config)
