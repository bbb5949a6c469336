"""A GGUF file of a family no public package ships here, for speed comparisons with llama.cpp:
Qwen2.5-0.5B's shape (24 layers of 896, 14 query heads and 2 KV heads of 64, q/k/v biases, a
tied vocabulary of 151,936) with random weights, in llama.cpp's Q4_K_M mix as llama-quantize
writes it for that shape, and a SentencePiece vocabulary of as many tokens that both servers
load. Random weights answer nonsense; a decode step's work is the real model's.

    python -m tests.generated_gguf qwen2.5-0.5b.Q4_K_M.gguf

The mix (llama.cpp's `llama_tensor_get_type` for Q4_K_M): Q4_K, with v and down in Q6_K in the
first and last eighth of the layers and every third between; rows that are no multiple of 256
fall back (Q4_K to Q5_0, Q6_K to Q8_0), as do all of this shape's but down's; the tied
embedding, which is also the output, in Q6_K's fallback Q8_0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import torch

from pagedserve.engine.models.model_config import ModelConfig
from tests.gguf_writer import SentencePieceVocabulary, write_gguf_like_llama_cpp

Q = gguf.GGMLQuantizationType
LAYERS = 24
SHAPE = dict(
    architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=LAYERS, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
    attention_bias=True, bos_token_id=1, eos_token_ids=(2,), rope_scaling=None,
    sliding_window=None,
)  # fmt: skip


def _more_bits(layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    eighth = LAYERS // 8
    return layer < eighth or layer >= 7 * LAYERS // 8 or (layer - eighth) % 3 == 2


def q4_k_m(name: str, k: int) -> Q:
    """The type llama-quantize gives transformers' tensor `name` of rows of `k` values."""
    layer = int(name.split(".")[2]) if ".layers." in name else -1
    wanted = Q.Q4_K
    if "embed_tokens" in name or (("v_proj" in name or "down_proj" in name) and _more_bits(layer)):
        wanted = Q.Q6_K
    if k % 256:
        return {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[wanted]
    return wanted


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def vocabulary(size: int) -> SentencePieceVocabulary:
    """<unk>, <s>, </s>, the 256 byte pieces, then pieces of their own."""
    t = gguf.TokenType
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = [f"\u2581w{i}" for i in range(size - len(specials) - len(pieces))]
    return SentencePieceVocabulary(
        tokens=specials + pieces + words,
        scores=[0.0] * (len(specials) + len(pieces)) + [-float(i) for i in range(len(words))],
        types=[t.UNKNOWN, t.CONTROL, t.CONTROL] + [t.BYTE] * len(pieces) + [t.NORMAL] * len(words),
        bos=1, eos=2, unk=0, pad=0, chat_template=TEMPLATE,
    )  # fmt: skip


def main(path: str) -> Path:
    config = ModelConfig(**SHAPE)
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(shape, generator=generator) * (1.0 if "norm" in name else 0.02)
        for name, shape in config.weight_shapes().items()
    }
    for name in weights:
        if "norm" in name:
            weights[name] = weights[name].abs() + 0.5
    shapes = {name: shape[-1] for name, shape in config.weight_shapes().items()}
    return write_gguf_like_llama_cpp(
        Path(path), config, weights, tensor_type=lambda name: q4_k_m(name, shapes[name]),
        vocabulary=vocabulary(config.vocab_size),
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the GGUF file to write")
    return parser


if __name__ == "__main__":
    print(main(build_parser().parse_args().path))
