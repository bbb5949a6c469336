"""GGUF files for tests, written the way llama.cpp's converter (convert_hf_to_gguf.py) writes a
Hugging Face checkpoint, family by family: the same architecture names and metadata keys, the
tensor names of gguf's own TensorNameMap (the table the converter maps with), and what the
converter changes in the tensors:

  llama, mistral, mixtral  q/k rows permuted for llama.cpp's interleaved RoPE; Mixtral is a
                           "llama" file with expert_count
  gemma2, gemma3_text      norm weights stored as 1 + w; no output.weight (tied)
  phi3                     LongRoPE factors as rope_factors_long/short tensors, no scaling type
  mixtral, qwen3_moe       experts stacked per layer: ffn_gate_exps, ffn_up_exps [E, I, H] and
                           ffn_down_exps [E, H, I]; the router is ffn_gate_inp
  all but gemma and phi3   no sliding window (llama.cpp runs Mistral, Mixtral and Qwen without)

In place of a vocabulary (`SentencePieceVocabulary` writes one) the file carries
`{arch}.vocab_size` and the bos/eos ids, so pagedserve serves it with its synthetic tokenizer.
`python -m tests.llama_cpp_gguf` checks these files against llama.cpp's own converter on the
tiny checkpoints of tests/families.py (docs/benchmarks-history.md, "GGUF files of every family").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from pagedserve.engine.models.model_config import ModelConfig
from tests import kquants

# pagedserve family -> llama.cpp architecture name.
LLAMA_CPP_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
_PERMUTED = ("llama", "mistral", "mixtral")


def llama_cpp_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf_like_llama_cpp(
    path: Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    tensor_type: gguf.GGMLQuantizationType
    | Callable[[str], gguf.GGMLQuantizationType] = gguf.GGMLQuantizationType.F32,
    vocabulary: SentencePieceVocabulary | None = None,
) -> Path:
    """Write `tensors` (transformers' own names, as `config.weight_shapes()` lists them) and
    `config`'s metadata as llama.cpp's converter would. `tensor_type` other than F32 quantizes
    every tensor of two or more dimensions (norms and other vectors stay F32, as llama.cpp keeps
    them) with gguf's own quantizer, or tests/kquants.py's for Q4_K / Q6_K; a function of the
    tensor's transformers name picks a type per tensor, as llama.cpp's Q4_K_M mix does.
    `vocabulary` replaces the vocab_size stand-in."""
    arch_name = LLAMA_CPP_ARCHITECTURES[config.architecture]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(path, arch_name)
    _write_metadata(writer, config)
    if vocabulary is None:
        writer.add_vocab_size(config.vocab_size)
        if config.bos_token_id is not None:
            writer.add_bos_token_id(config.bos_token_id)
        if config.eos_token_ids:
            writer.add_eos_token_id(config.eos_token_ids[0])
    else:
        vocabulary.write(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a state_dict lists the tied copy; checkpoints (and converters) do not
        for name, data in _converted(config, hf_name, tensor.detach().float()):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, f"gguf's TensorNameMap has no name for {name}"
            array = data.contiguous().numpy()
            qtype = tensor_type(name) if callable(tensor_type) else tensor_type
            if qtype != gguf.GGMLQuantizationType.F32 and array.ndim >= 2:
                writer.add_tensor(gguf_name, kquants.quantize(array, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, array)
    if config.rope_scaling_dict() and config.rope_scaling_dict()["rope_type"] == "longrope":
        scaling = config.rope_scaling_dict()
        for kind in ("long", "short"):
            factors = np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converted(config: ModelConfig, name: str, t: torch.Tensor):
    """(name the tensor map knows, tensor) pairs for one transformers tensor, changed as the
    converter's `modify_tensors` of the family changes it."""
    if config.architecture in _PERMUTED:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if ".q_proj." in name:
            t = llama_cpp_permute(t, heads, heads)
        elif ".k_proj." in name:
            t = llama_cpp_permute(t, heads, kv_heads)
    if config.is_gemma and name.endswith("norm.weight"):
        t = t + 1
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: the converter splits it
        stem, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
        yield stem + "gate_proj.weight", t[:, :inter]
        yield stem + "up_proj.weight", t[:, inter:]
    elif name.endswith(".mlp.experts.down_proj"):
        yield name + ".weight", t
    else:
        yield name, t


def _write_metadata(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    """The keys the converter's `set_gguf_parameters` writes for the family."""
    arch = c.architecture
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch != "phi3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    scaling = c.rope_scaling_dict() or {}
    if arch != "gemma2":  # Gemma 2's converter writes no rope base (llama.cpp's default holds)
        w.add_rope_freq_base(c.rope_theta)
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if c.local_rope_theta is not None:
        w.add_rope_freq_base_swa(c.local_rope_theta)
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch in _PERMUTED or arch == "phi3":
        w.add_rope_dimension_count(c.head_dim)
    if c.is_gemma:
        if c.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "phi3":
        w.add_sliding_window(c.sliding_window or 0)  # 0: none (Phi-4)
        if scaling.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            w.add_rope_scaling_attn_factors(_longrope_attn_factor(scaling))
    elif c.is_gemma and c.sliding_window is not None:
        # The other families' converters drop the window (llama.cpp runs them without one).
        w.add_sliding_window(c.sliding_window)


@dataclass
class SentencePieceVocabulary:
    """A SentencePiece vocabulary as the converter's `_set_vocab_sentencepiece` writes it (Gemma,
    Phi-3, Llama 2): every token with its score and type, the special ids, the chat template."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # gguf.TokenType values
    bos: int
    eos: int
    unk: int
    pad: int
    chat_template: str
    add_bos: bool = True

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(self.tokens)
        w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        w.add_bos_token_id(self.bos)
        w.add_eos_token_id(self.eos)
        w.add_unk_token_id(self.unk)
        w.add_pad_token_id(self.pad)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        w.add_chat_template(self.chat_template)


def _longrope_attn_factor(scaling: dict) -> float:
    # Phi3MiniModel.generate_extra_tensors: sqrt(1 + ln(scale) / ln(original)) past the original.
    scale = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
