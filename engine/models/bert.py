"""BERT (`BertModel` folders, e.g. sentence-transformers' all-MiniLM-L6-v2): an encoder-only
model whose last hidden states the engine pools into embeddings (engine/worker/pooler.py). Its
configuration: engine/models/bert_config.py.

BERT in brief: word + learned position + token-type embeddings -> LayerNorm -> post-norm layers
(bidirectional self-attention with biases, + residual, LayerNorm; a GELU MLP, + residual,
LayerNorm). Parameter names are transformers' (a `bert.` prefix, as BertFor* checkpoints save
it, is dropped; the pooler head and the MLM head are not used).

It keeps no KV cache: a request's whole prompt runs in one step (the scheduler's
`prefill_only`), and every token attends to every token of its own sequence. The step's
sequences are packed one after the other as for a decoder (`AttentionMetadata.query_start_loc`);
attention runs per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.bert_config import BertConfig
from pagedserve.engine.models.weights import iter_safetensors_weights

if TYPE_CHECKING:
    from pagedserve.engine.models.model_source import ModelSource

logger = logging.getLogger("pagedserve")

# Checkpoint tensors BertModel's encoder does not use.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class _Dense(nn.Module):
    """A projection, then LayerNorm of it plus the residual (BERT's post-norm)."""

    def __init__(self, c: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Dense(c, c.hidden_size)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Dense(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        a = self.attention.self
        n = x.shape[0]
        # [heads, tokens, head_dim], then each sequence's own slice: no token sees another's.
        q, k, v = (
            p(x).view(n, self.heads, self.head_dim).transpose(0, 1)
            for p in (a.query, a.key, a.value)
        )
        context = torch.cat(
            [
                F.scaled_dot_product_attention(qs, ks, vs)
                for qs, ks, vs in zip(
                    q.split(seq_lens, 1), k.split(seq_lens, 1), v.split(seq_lens, 1), strict=True
                )
            ],
            dim=1,
        )
        h = self.attention.output(context.transpose(0, 1).reshape(n, -1), x)
        return self.output(F.gelu(self.intermediate.dense(h)), h)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))


class BertModel(nn.Module):
    """BERT's encoder: token ids of packed sequences -> their last hidden states."""

    is_encoder_decoder = False
    is_encoder_only = True

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]):
        """[num_tokens] ids and positions of sequences of `seq_lens` tokens, one after the
        other -> [num_tokens, hidden_size]. Token type 0 throughout (a single text each, as
        sentence-transformers encodes it)."""
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(positions)
        x = e.LayerNorm(x + e.token_type_embeddings.weight[0])
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The model runner's call, as for a decoder; there is no KV to read or write, and
        each sequence is whole in the step (so its lengths are the step's query lengths)."""
        del kv_caches
        seq_lens = torch.diff(meta.query_start_loc).tolist()
        return self.encode(input_ids, positions, seq_lens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Transformers' names; every parameter must come, and nothing unknown may."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES):
                continue
            if name not in params:
                raise ValueError(f"unexpected BERT weight {name!r}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"BERT weight {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"BERT weights missing: {', '.join(missing[:5])}")


def load_bert_model(
    source: ModelSource, load_format: str, device: torch.device, dtype: torch.dtype
) -> BertModel:
    """The model of a BERT source on its device and dtype: the folder's safetensors, or random
    weights (the caller seeds them) for a config file or --load-format dummy."""
    config = source.config.bert
    with device:
        model = BertModel(config).eval()
    folder = source.path if source.kind == "hf_dir" else None
    if load_format == "dummy" or folder is None:
        logger.warning("BERT model %r: random weights", source.name)
    elif load_format in ("auto", "safetensors"):
        model.load_weights(iter_safetensors_weights(folder, progress=False))
    else:
        raise ValueError(f"--load-format {load_format} does not read BERT folders")
    return model.to(device, dtype)
