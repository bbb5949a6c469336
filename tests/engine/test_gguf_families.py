"""GGUF files of Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE, written from the tiny
checkpoints of tests/families.py the way llama.cpp's converter writes them
(tests/gguf_writer.py): pagedserve reads back the checkpoint's config and tensors, and its
greedy tokens from the GGUF file equal transformers' on the original checkpoint, prompts past
the sliding windows included; quantized files load as gguf dequantizes them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.models.gguf_config import config_from_gguf
from pagedserve.engine.models.hf_config import config_from_json_file
from pagedserve.engine.models.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from pagedserve.engine.models.weights import iter_gguf_weights
from tests.engine.test_model_families import _greedy, _llm, _prompts
from tests.families import FAMILIES, GGUF_CHANGES, build_family
from tests.gguf_writer import SentencePieceVocabulary, write_gguf_like_llama_cpp
from tests.helpers import hf_greedy


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (its GGUF file, the transformers model, the checkpoint's ModelConfig)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            hf = build_family(name, folder, **GGUF_CHANGES.get(name, {}))
            config = config_from_json_file(folder / "config.json")
            path = write_gguf_like_llama_cpp(folder / f"{name}.gguf", config, hf.state_dict())
            cache[name] = (path, hf, config)
        return cache[name]

    return get


def _reference_tensors(hf) -> dict[str, torch.Tensor]:
    """The model's tensors in the names a GGUF file yields them under (experts' gate and up
    stacked apart)."""
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            stem, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            tensors[stem + "gate_proj"], tensors[stem + "up_proj"] = t[:, :inter], t[:, inter:]
        else:
            tensors[name] = t
    return tensors


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_and_tensors_read_back_from_the_gguf_file(name, converted):
    path, hf, config = converted(name)
    reader = gguf.GGUFReader(path)
    assert config_from_gguf(reader) == dataclasses.replace(config, torch_dtype=None)
    loaded = dict(iter_gguf_weights(reader, config, progress=False))
    reference = _reference_tensors(hf)
    if config.tie_word_embeddings:
        del reference["lm_head.weight"]
    assert loaded.keys() == reference.keys()
    for key, tensor in loaded.items():
        if config.is_gemma and key.endswith("norm.weight"):
            # Stored as 1 + w in float32, read back as (1 + w) - 1: w to within 2 ** -24.
            torch.testing.assert_close(tensor, reference[key], rtol=0, atol=2**-24)
        else:
            assert torch.equal(tensor, reference[key]), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_from_the_gguf_file_equals_transformers(name, converted):
    path, hf, _ = converted(name)
    prompts = _prompts(5)  # 1, 5, 13 and 30 tokens: past the 8-token windows of Gemma and Phi-3
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = _llm(path)
    assert _greedy(llm, prompts, 8) == expected
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_quantized_moe_file_runs_as_its_dequantized_weights(name, converted, tmp_path):
    """Q8_0 experts, router and projections (3-D tensors included) load as gguf's own
    dequantization of them, and give the tokens of transformers holding those same weights."""
    _, hf, config = converted(name)
    path = write_gguf_like_llama_cpp(
        tmp_path / "q8.gguf", config, hf.state_dict(), tensor_type=gguf.GGMLQuantizationType.Q8_0
    )
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    loaded = dict(iter_gguf_weights(reader, config, progress=False))
    reference = _reference_tensors(hf)
    stacked = [k for k in loaded if ".mlp.experts." in k]
    assert len(stacked) == 3 * config.num_hidden_layers
    for key, tensor in loaded.items():
        if tensor.dim() >= 2:
            want = gguf.quants.dequantize(
                gguf.quants.quantize(reference[key].numpy(), gguf.GGMLQuantizationType.Q8_0),
                gguf.GGMLQuantizationType.Q8_0,
            )
            assert np.array_equal(tensor.numpy(), want), key
            assert not torch.equal(tensor, reference[key]), key  # really quantized
        else:
            assert torch.equal(tensor, reference[key]), key

    # transformers with the dequantized weights put in, as the reference.
    state = hf.state_dict()
    with torch.no_grad():
        for key, tensor in loaded.items():
            if key.endswith(".mlp.experts.gate_proj") or key.endswith(".mlp.experts.up_proj"):
                fused = state[key.rsplit(".", 1)[0] + ".gate_up_proj"]
                inter = fused.shape[1] // 2
                half = slice(0, inter) if key.endswith("gate_proj") else slice(inter, None)
                fused[:, half].copy_(tensor)
            else:
                state[key].copy_(tensor)
    prompts = _prompts(6, [4, 11])
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    assert _greedy(_llm(path), prompts, 6) == expected


# Gemma 3's chat template (its tokenizer_config.json's, without the system-prompt branches).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _gemma_vocabulary() -> SentencePieceVocabulary:
    """256 tokens spelled like Gemma's: its specials first, then pieces, then unused ones."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\n", "\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["he", "ll", "hell", "hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world"]
    unused = [f"<unused{i}>" for i in range(256 - len(specials) - len(pieces))]
    t = gguf.TokenType
    return SentencePieceVocabulary(
        tokens=specials + pieces + unused,
        scores=[0.0] * len(specials) + [-float(i) for i in range(len(pieces))]
        + [-1000.0] * len(unused),
        types=[t.CONTROL] * len(specials) + [t.NORMAL] * len(pieces) + [t.UNUSED] * len(unused),
        bos=2, eos=1, unk=3, pad=0, chat_template=GEMMA3_TEMPLATE,
    )  # fmt: skip


def test_a_gemma_file_with_its_vocabulary_chats_and_stops_at_end_of_turn(converted, tmp_path):
    """Gemma's GGUF files name only <eos> as their end; chat turns end with <end_of_turn>,
    which llama.cpp (and so pagedserve) finds by its spelling."""
    _, hf, config = converted("gemma3")
    vocabulary = _gemma_vocabulary()
    path = write_gguf_like_llama_cpp(
        tmp_path / "gemma3-chat.gguf", config, hf.state_dict(), vocabulary=vocabulary
    )
    llm = _llm(path)
    assert llm.engine.core.eos_token_ids == (1, 5)  # <eos>, <end_of_turn>
    out = llm.chat(
        [{"role": "user", "content": "hello world"}],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    ids = {token: i for i, token in enumerate(vocabulary.tokens)}
    user_turn = ["<bos>", "<start_of_turn>", "u", "s", "e", "r", "\n", "hello", "\u2581world"]
    model_turn = ["<end_of_turn>", "\n", "<start_of_turn>", "m", "o", "d", "e", "l", "\n"]
    assert out.prompt_token_ids == [ids[t] for t in user_turn + model_turn]
    expected = hf_greedy(hf, out.prompt_token_ids, 6)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == "".join(vocabulary.tokens[i] for i in expected).replace(
        "\u2581", " "
    )


# ---------------------------------------------------------------------- what files leave out


def _metadata_file(path: Path, arch: str, layers: int, **keys) -> gguf.GGUFReader:
    """A weightless GGUF file of llama.cpp architecture `arch` (the tensor list holds a router
    for every layer listed in `keys['routed']`, and the q/k norms Gemma 3 has)."""
    routed = keys.pop("routed", ())
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    writer.add_key_length(keys.pop("key_length", 32))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(1000)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    for i in routed:
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", np.zeros((4, 256), dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((1000, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def test_from_gguf_assumes_what_llama_cpp_assumes(tmp_path: Path):
    sliding, full = SLIDING_ATTENTION, FULL_ATTENTION
    # Gemma 2 without a window key: llama.cpp's 4096, every other layer from layer 0, the softcaps
    # llama.cpp defaults to, and head_dim's scale (not a 27B: 26 layers).
    g2 = config_from_gguf(_metadata_file(tmp_path / "g2.gguf", "gemma2", 4))
    assert (g2.architecture, g2.sliding_window, g2.layer_types) == (
        "gemma2", 4096, (sliding, full, sliding, full)
    )  # fmt: skip
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert (g2.query_pre_attn_scalar, g2.hidden_act, g2.tie_word_embeddings) == (
        32.0, "gelu_pytorch_tanh", True
    )  # fmt: skip
    # Gemma 2 27B (46 layers) scales by hidden_size / heads, 32 here as head_dim is 128.
    g27 = config_from_gguf(_metadata_file(tmp_path / "g27.gguf", "gemma2", 46, key_length=128))
    assert (g27.query_pre_attn_scalar, g27.head_dim) == (32.0, 128)
    # Gemma 3: five sliding layers then a global one, local base 10000 unless stored; a stored
    # attention scale wins over the 27B rule; a per-layer pattern wins over the period.
    g3 = config_from_gguf(
        _metadata_file(tmp_path / "g3.gguf", "gemma3", 7, sliding_window=512, rope_freq_base=1e6)
    )
    assert g3.layer_types == (sliding,) * 5 + (full, sliding)
    assert (g3.rope_theta, g3.local_rope_theta, g3.final_logit_softcapping) == (1e6, 1e4, None)
    scaled = config_from_gguf(
        _metadata_file(
            tmp_path / "g3s.gguf", "gemma3", 3, sliding_window=512, attention_scale=0.125,
            sliding_window_pattern=[True, False, True], rope_freq_base_swa=5000.0,
        )
    )  # fmt: skip
    assert (scaled.query_pre_attn_scalar, scaled.local_rope_theta) == (64.0, 5000.0)
    assert scaled.layer_types == (sliding, full, sliding)
    # Phi-3 writes 0 for no window (Phi-4); without rope factor tensors there is no scaling.
    phi = config_from_gguf(_metadata_file(tmp_path / "p.gguf", "phi3", 2, sliding_window=0))
    assert (phi.sliding_window, phi.layer_types, phi.rope_scaling) == (None, (full, full), None)
    # Qwen3-MoE: layers without a router keep a dense MLP; llama.cpp renormalises the top k.
    moe = config_from_gguf(
        _metadata_file(
            tmp_path / "m.gguf", "qwen3moe", 3, expert_count=4, expert_used_count=2,
            expert_feed_forward_length=64, routed=(0, 2),
        )
    )  # fmt: skip
    assert (moe.architecture, moe.num_experts, moe.moe_intermediate_size) == ("qwen3_moe", 4, 64)
    assert (moe.dense_layers, moe.norm_topk_prob, moe.intermediate_size) == ((1,), True, 512)
    # A "llama" file with experts is Mixtral.
    mixtral = config_from_gguf(
        _metadata_file(
            tmp_path / "x.gguf", "llama", 2, expert_count=8, expert_used_count=2, routed=(0, 1)
        )
    )
    assert (mixtral.architecture, mixtral.moe_intermediate_size, mixtral.dense_layers) == (
        "mixtral", 512, ()
    )  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window_pattern has 2 entries for 3 layers"):
        config_from_gguf(
            _metadata_file(
                tmp_path / "bad.gguf", "gemma3", 3, sliding_window=8,
                sliding_window_pattern=[True, False],
            )
        )  # fmt: skip
