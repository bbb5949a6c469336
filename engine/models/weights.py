"""Weight iterators that yield `(name, tensor)` in Hugging Face parameter naming.

Every source — safetensors shards, a (quantized) GGUF file, random dummy weights — yields the
same names (`ModelConfig.weight_shapes()`), so the model's loader has one job: copy by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from pagedserve.engine.engine_config import LOAD_FORMATS
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import GGUFFile, ModelSource
from pagedserve.engine.models.quantized_linear import KEPT_TYPES, QuantizedRows, gguf_rows

# GGUF tensor name (inside blk.N.) -> Hugging Face module name (inside model.layers.N.), as
# llama.cpp's converter maps them (gguf.TensorNameMap); families that differ override entries.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
_GGUF_FAMILY_LAYER_NAMES = {
    # Gemma's four norms per layer: ffn_norm is the one before the MLP here.
    **dict.fromkeys(
        ("gemma2", "gemma3_text"),
        {
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Stacked experts [E, out, in], named like transformers 5's stacked tensors (no ".weight"); gate
# and up fill the two halves of `mlp.experts.gate_up_proj` (engine/models/model.py
# `_expert_targets`).
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that are not model parameters: rope_freqs holds llama3 rope scaling,
# rope_factors_* Phi-3's LongRoPE factors, both already in config.rope_scaling
# (gguf_config.config_from_gguf).
_GGUF_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# llama.cpp's converter permutes q/k rows for these families (Mistral and Mixtral are converted
# as "llama"); the others are stored unpermuted.
PERMUTED_ARCHITECTURES = ("llama", "mistral", "mixtral")


def gguf_to_hf_name(gguf_name: str, architecture: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of a model of `architecture` (ModelConfig's);
    None for tensors that are not parameters.

    Raises ValueError for a tensor name this loader does not know.
    """
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    if gguf_name in _GGUF_SKIPPED:
        return None
    m = _GGUF_BLOCK_RE.match(gguf_name)
    if m is not None:
        layer, module, kind = m.groups()
        if module in _GGUF_EXPERT_NAMES and kind == "weight":
            return f"model.layers.{layer}.{_GGUF_EXPERT_NAMES[module]}"
        names = {**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_LAYER_NAMES.get(architecture, {})}
        if module in names:
            return f"model.layers.{layer}.{names[module]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for a {architecture} model")


def gguf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF-named tensors a GGUF file of `config` holds, with their shapes:
    `ModelConfig.weight_shapes()`, with each stacked `gate_up_proj` of experts in its two halves
    (`mlp.experts.gate_proj`, `mlp.experts.up_proj`), as llama.cpp stores them."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            e, two_inter, h = shape
            stem = name.removesuffix("gate_up_proj")
            shapes[stem + "gate_proj"] = shapes[stem + "up_proj"] = (e, two_inter // 2, h)
        else:
            shapes[name] = shape
    return shapes


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (weights `[out, in]` or biases `[out]`).

    HF orders each head's rotary dims as two halves [x0..x(d/2-1) | y0..y(d/2-1)] (rotate_half);
    GGUF interleaves them as pairs [x0 y0 x1 y1 ...]. The converter does

        w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    so row (h, j, i) of GGUF is row (h, i, j) of HF; swapping the same two axes back inverts it.
    """
    head_dim = w.shape[0] // num_heads
    if head_dim * num_heads != w.shape[0] or head_dim % 2:
        raise ValueError(f"cannot unpermute shape {w.shape} into {num_heads} heads of even size")
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of `unpermute_qk`); used to write GGUFs."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _is_matmul_weight(name: str) -> bool:
    """A 2-D weight `linear` multiplies by (projections, lm_head, a possibly tied embedding), as
    opposed to norms, biases, routers and stacked experts."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def iter_gguf_weights(
    path: str | Path | gguf.GGUFReader,
    config: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Dequantize every tensor of a GGUF file into `(hf_name, tensor)` (float32 unless `dtype`).

    `path` may also be an open `gguf.GGUFReader`, to avoid parsing the file twice. What
    llama.cpp's converter changed is undone: the row permutation of q/k weights (and biases) of
    llama/mistral/mixtral files, and the 1 + w it stores for Gemma's norms. Every tensor is
    checked against the shape `config` expects (`gguf_weight_shapes`).

    `keep_quantized`: matmul weights of the kept block types (quantized_linear.py `KEPT_TYPES`:
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) come as `QuantizedRows` (the file's
    blocks, rows unpermuted likewise) instead (engine/models/quantized_linear.py).
    """
    reader = path if isinstance(path, gguf.GGUFReader) else GGUFFile(path)
    expected = gguf_weight_shapes(config)
    permuted = config.architecture in PERMUTED_ARCHITECTURES
    for t in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", disable=not progress):
        name = gguf_to_hf_name(t.name, config.architecture)
        if name is None:
            continue
        if name not in expected:
            raise ValueError(f"GGUF tensor {t.name!r} ({name}) does not belong to this config")
        # GGUF lists dimensions innermost first: reversed, the shape is torch's [out, in].
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != expected[name]:
            raise ValueError(
                f"GGUF tensor {t.name!r} has shape {shape}, config expects {expected[name]} "
                f"for {name}"
            )
        heads = None
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        if keep_quantized and t.tensor_type in KEPT_TYPES and _is_matmul_weight(name):
            rows = gguf_rows(t.data, t.tensor_type, shape)
            yield (
                name,
                rows
                if heads is None
                else rows.select_rows(lambda a, heads=heads: unpermute_qk(a, heads)),
            )
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if heads is not None:
            arr = unpermute_qk(arr, heads)
        if config.is_gemma and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights w as the factor 1 + w.
            arr = arr - np.float32(1.0)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those only.
        if not (arr.flags.writeable and arr.flags.c_contiguous and arr.dtype == np.float32):
            arr = np.array(arr, dtype=np.float32, order="C", copy=True)
        tensor = torch.from_numpy(arr)
        yield name, tensor if dtype is None else tensor.to(dtype)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    # Mistral repos ship their own format (consolidated.safetensors) next to the HF shards.
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    return hf_files or files


# Where a multimodal checkpoint (engine/models/model_config.py `MULTIMODAL_TEXT_MODELS`) keeps its
# language model, as saved by transformers 4 (the published files) and 5 -> the text model's own
# names; and what else it holds, which pagedserve does not run.
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector.")  # fmt: skip


def _text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model (None: a multimodal part to skip)."""
    if name.startswith(MULTIMODAL_SKIPPED):
        return None
    for prefix, replacement in MULTIMODAL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def iter_safetensors_weights(
    folder: str | Path, *, dtype: torch.dtype | None = None, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors files, as stored (HF names already; a
    multimodal checkpoint's language model renamed to the text model's names, its other parts
    skipped).

    Uses the shard list of `model.safetensors.index.json` when present. Skips rotary
    `inv_freq` buffers some old checkpoints carry.
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = _safetensors_files(folder)
    if not files:
        raise ValueError(
            f"no *.safetensors files in {str(folder)!r} (only safetensors checkpoints are "
            "supported; convert .bin files or use --load-format dummy)"
        )
    num_tensors = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            num_tensors += len(f.keys())
    with tqdm(
        total=num_tensors, desc="Loading safetensors", unit="tensor", disable=not progress
    ) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    bar.update(1)
                    name = _text_model_name(stored)
                    if name is None or name.endswith("rotary_emb.inv_freq"):
                        continue
                    tensor = f.get_tensor(stored)
                    yield name, tensor if dtype is None else tensor.to(dtype)


def dummy_weights(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights for any config: normal(0, 0.02) for matrices and biases, ones for norms.

    Deterministic for a given (config, seed, device type): values are drawn in float32 from a
    generator seeded once, in `weight_shapes()` order, then cast to `dtype`.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            tensor = torch.empty(shape, dtype=torch.float32, device=device)
            tensor.normal_(mean=0.0, std=0.02, generator=generator)
        yield name, tensor.to(dtype)


def load_weights(
    source: ModelSource,
    load_format: str = "auto",
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Weights of `source` in Hugging Face naming.

    load_format "auto" picks by source kind (hf_dir -> safetensors, gguf -> gguf, dummy ->
    dummy); "dummy" works for any source. `dtype` None keeps the stored dtype (float32 for GGUF
    and dummy weights). `keep_quantized`: a GGUF file's quantized matmul weights come as
    `QuantizedRows` (`iter_gguf_weights`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format == "auto":
        load_format = {"hf_dir": "safetensors", "gguf": "gguf", "dummy": "dummy"}[source.kind]
    if load_format == "dummy":
        return dummy_weights(source.config, dtype or torch.float32)
    if load_format == "safetensors":
        if source.kind != "hf_dir" or source.path is None:
            raise ValueError(
                f"load format 'safetensors' needs a Hugging Face folder, but model "
                f"{source.name!r} is a {source.kind} source"
            )
        return iter_safetensors_weights(source.path, dtype=dtype, progress=progress)
    if source.kind != "gguf" or source.gguf_file is None:
        raise ValueError(
            f"load format 'gguf' needs a .gguf file, but model {source.name!r} is a "
            f"{source.kind} source"
        )
    gguf_input = source.gguf_file if source.gguf_reader is None else source.gguf_reader
    return iter_gguf_weights(
        gguf_input, source.config, dtype=dtype, progress=progress, keep_quantized=keep_quantized
    )
