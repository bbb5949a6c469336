"""Reading a LoRA adapter in GGUF, as llama.cpp's convert_lora_to_gguf.py writes one.

The converter runs the base model's own tensor conversion over each LoRA pair, so the file
carries what that conversion did: GGUF tensor names (`blk.N.attn_q.weight.lora_a`), and for the
families whose q/k rows llama.cpp permutes (engine/models/weights.py `PERMUTED_ARCHITECTURES`)
lora_b of attn_q and attn_k permuted the same way (only B's rows are outputs; A is untouched).
The names are mapped back with the base loader's own table (`gguf_to_hf_name`) and the rows
unpermuted, so that `adapter.build_adapter` checks the result exactly as it checks a PEFT
folder. The scaling is llama.cpp's: alpha / r, or 1 when the file's alpha is 0 or absent (the
converter ignores rsLoRA).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from pagedserve.engine.lora.adapter import (
    MISMATCH_REMEDY,
    UNSUPPORTED_REMEDY,
    FoundLoRA,
    LoRAAdapter,
    build_adapter,
    refusal,
    unknown_modules_refusal,
)
from pagedserve.engine.models.gguf_config import GGUF_ARCHITECTURES
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.model_source import GGUFFile
from pagedserve.engine.models.weights import (
    PERMUTED_ARCHITECTURES,
    gguf_to_hf_name,
    unpermute_qk,
)

_TENSOR_RE = re.compile(r"^(?P<base>.+)\.lora_(?P<ab>[ab])$")
_LAYER_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<path>.+?)(?:\.weight)?$")
# llama.cpp converts Mistral and Mixtral as "llama" files.
_LLAMA_FILE_FAMILIES = ("llama", "mistral", "mixtral")


def read_gguf_adapter(path: Path, config: ModelConfig, max_rank: int, name: str) -> LoRAAdapter:
    """A llama.cpp LoRA .gguf file as `adapter.load_adapter` returns it (see there)."""
    reader = _open(path, name)
    _check_metadata(reader, config, path, name)
    tensors = _lora_tensors(reader, config, path, name)
    ranks = sorted({b.shape[1] for _, b in tensors.values() if b.dim() == 2})
    if len(ranks) > 1:
        problem = f"its tensors have ranks {ranks}; one rank per adapter is supported"
        raise refusal(name, path, problem, UNSUPPORTED_REMEDY)
    rank = ranks[0] if ranks else 0
    alpha = float(_field(reader, gguf.Keys.Adapter.LORA_ALPHA) or 0.0)
    # llama.cpp's rule (llama-adapter.cpp): no alpha means no scaling.
    scale = alpha / rank if alpha and rank else 1.0
    return build_adapter(FoundLoRA(tensors, rank, scale), config, max_rank, name, path)


def _open(path: Path, name: str) -> gguf.GGUFReader:
    try:
        return GGUFFile(path)
    except Exception as e:  # gguf raises whatever its parser meets in a foreign file
        problem = f"it is not a readable GGUF file ({e})"
        raise refusal(name, path, problem, "give a file convert_lora_to_gguf.py wrote") from e


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _check_metadata(reader: gguf.GGUFReader, config: ModelConfig, path: Path, name: str) -> None:
    kind = (_field(reader, gguf.Keys.General.TYPE), _field(reader, gguf.Keys.Adapter.TYPE))
    if kind != ("adapter", "lora"):
        problem = f"it is not a LoRA adapter (general.type, adapter.type = {kind})"
        remedy = "give a LoRA .gguf file (convert_lora_to_gguf.py writes them)"
        raise refusal(name, path, problem, remedy)
    if _field(reader, gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        problem = "it is an activated LoRA (aLoRA), which pagedserve does not support"
        raise refusal(name, path, problem, UNSUPPORTED_REMEDY)
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    same = GGUF_ARCHITECTURES.get(arch) == config.architecture
    if not same and not (arch == "llama" and config.architecture in _LLAMA_FILE_FAMILIES):
        problem = f"it is for a {arch} model, this one is {config.architecture}"
        raise refusal(name, path, problem, MISMATCH_REMEDY)


def _lora_tensors(
    reader: gguf.GGUFReader, config: ModelConfig, path: Path, name: str
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """(layer, module name) -> (A, B) of every LoRA pair, B's q/k rows unpermuted."""
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    for t in reader.tensors:
        layer, module_path, ab = _parse_name(t.name, config, path, name)
        module = module_path.rsplit(".", 1)[-1]
        tensor = _to_float32(t)
        if ab == "b":
            tensor = _unpermuted(tensor, module, config)
        halves.setdefault((layer, module), {})[ab] = tensor
    pairs = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"a", "b"}:
            problem = f"layer {layer}'s {module} has lora_{next(iter(ab))} without its other half"
            raise refusal(name, path, problem, "convert the adapter again")
        pairs[layer, module] = (ab["a"], ab["b"])
    return pairs


def _parse_name(gguf_name: str, config: ModelConfig, path: Path, name: str) -> tuple[int, str, str]:
    """(layer, module path in the layer, "a" or "b") of a LoRA tensor; refuses anything else."""
    m = _TENSOR_RE.match(gguf_name)
    if m is None:
        # The converter keeps norms an adapter carries (mergekit-extract-lora's) as full tensors.
        problem = f"it holds a tensor that is not a LoRA A or B ({gguf_name}); such adapters are"
        raise refusal(name, path, f"{problem} not supported", UNSUPPORTED_REMEDY)
    base = m["base"]
    if base.startswith(("token_embd.", "output.")):
        problem = (
            f"it holds a LoRA on the embeddings ({gguf_name}); adapters that add tokens or "
            "change embeddings are not supported"
        )
        raise refusal(name, path, problem, UNSUPPORTED_REMEDY)
    try:
        hf_name = gguf_to_hf_name(base, config.architecture)
    except ValueError:
        hf_name = None
    layer = None if hf_name is None else _LAYER_RE.match(hf_name)
    if layer is None:
        raise unknown_modules_refusal([base], config, name, path)
    if ".experts." in f".{layer['path']}.":
        problem = f"it targets {base}; LoRA on the experts of a mixture of experts is not supported"
        raise refusal(name, path, problem, "use an adapter that targets attention only")
    return int(layer["layer"]), layer["path"], m["ab"]


def _to_float32(t: gguf.gguf_reader.ReaderTensor) -> Tensor:
    # GGUF lists dimensions innermost first: reversed, the shape is torch's ([r, in], [out, r]).
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    # dequantize covers F32, F16, BF16 (stored as raw bytes) and the quantized types alike.
    array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def _unpermuted(b: Tensor, module: str, config: ModelConfig) -> Tensor:
    if config.architecture not in PERMUTED_ARCHITECTURES or module not in ("q_proj", "k_proj"):
        return b
    heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
    if b.dim() != 2 or b.shape[0] != heads * config.head_dim:
        return b  # a size this model does not have: build_adapter refuses it by name
    return torch.from_numpy(np.ascontiguousarray(unpermute_qk(b.numpy(), heads)))
