"""Random LoRA adapters for tests: PEFT's own (`get_peft_model` + `save_pretrained`) around a
tiny transformers model, and the same adapter as llama.cpp's convert_lora_to_gguf.py writes it.

The PEFT model is the reference the engine is compared with, so the helpers return it as well as
saving it. `init_lora_weights=False` draws B at random too (PEFT's default starts B at zero,
which would make every adapter a no-op). The GGUF writer follows the converter: the base model's
tensor names (gguf's TensorNameMap, as the base model's converter maps them) with `.lora_a` /
`.lora_b` appended, lora_b of q and k permuted like the base weights for the families llama.cpp
permutes, and the `general.type`, `adapter.type` and `adapter.lora.alpha` metadata.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedserve.engine.models.model_config import ModelConfig
from tests.gguf_writer import LLAMA_CPP_ARCHITECTURES, llama_cpp_permute

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
_PERMUTED = ("llama", "mistral", "mixtral")


def random_peft_model(
    model: torch.nn.Module,
    r: int,
    alpha: float,
    target_modules: Sequence[str],
    seed: int,
    use_rslora: bool = False,
    **lora_options: Any,
):
    """A PEFT LoRA model (eval mode) around a copy of `model`, which stays as it was; A and B
    are drawn from `seed` alone (the global RNG is left untouched)."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False,
        use_rslora=use_rslora, **lora_options,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(model), lora_config).eval()


def save_random_peft_adapter(
    model: torch.nn.Module,
    path: str | Path,
    r: int,
    alpha: float,
    target_modules: Sequence[str],
    seed: int,
    use_rslora: bool = False,
    **lora_options: Any,
) -> Path:
    """`random_peft_model` saved with `save_pretrained` into `path` (the adapter folder)."""
    peft_model = random_peft_model(
        model, r, alpha, target_modules, seed, use_rslora, **lora_options
    )
    peft_model.save_pretrained(path)
    return Path(path)


def peft_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The saved LoRA tensors of a PEFT folder, by their stored names."""
    from safetensors.torch import load_file

    return load_file(Path(folder) / WEIGHTS_FILE)


def peft_pair(tensors: dict[str, torch.Tensor], layer: int, module: str) -> tuple:
    """(lora_A, lora_B) of `module` ("self_attn.q_proj", "mlp.down_proj", ...) in `layer`."""
    stem = f"base_model.model.model.layers.{layer}.{module}"
    return tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]


def gguf_lora_tensors(config: ModelConfig, folder: str | Path) -> dict[str, np.ndarray]:
    """A PEFT folder's tensors as convert_lora_to_gguf.py names and changes them."""
    arch_name = LLAMA_CPP_ARCHITECTURES[config.architecture]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for key, tensor in peft_tensors(folder).items():
        # The converter's get_base_tensor_name, then the base model's own conversion.
        kind = "a" if ".lora_A." in key else "b"
        hf_name = key.replace("base_model.model.", "").replace(f".lora_{kind.upper()}", "")
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert gguf_name is not None, f"gguf's TensorNameMap has no name for {hf_name}"
        tensor = tensor.float()
        if kind == "b" and config.architecture in _PERMUTED:
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            if ".q_proj." in hf_name:
                tensor = llama_cpp_permute(tensor, heads, heads)
            elif ".k_proj." in hf_name:
                tensor = llama_cpp_permute(tensor, heads, kv_heads)
        out[f"{gguf_name}.lora_{kind}"] = tensor.contiguous().numpy()
    return out


def write_gguf_lora_tensors(
    path: str | Path,
    arch_name: str,
    tensors: dict[str, np.ndarray],
    alpha: float | None,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    metadata: dict[str, str] | None = None,
) -> Path:
    """A LoRA .gguf of llama.cpp architecture `arch_name` holding `tensors` (GGUF names), with the
    converter's metadata (`metadata` overrides string keys; alpha None leaves it out)."""
    writer = gguf.GGUFWriter(path, arch_name)
    strings = {gguf.Keys.General.TYPE: gguf.GGUFType.ADAPTER, gguf.Keys.Adapter.TYPE: "lora"}
    for key, value in {**strings, **(metadata or {})}.items():
        writer.add_string(key, value)
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, array in tensors.items():
        if tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif tensor_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:  # BF16 and the quantized types: gguf's own quantizer, stored raw
            quantized = gguf.quants.quantize(array.astype(np.float32), tensor_type)
            writer.add_tensor(name, quantized, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_gguf_lora(
    path: str | Path,
    config: ModelConfig,
    folder: str | Path,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> Path:
    """The PEFT adapter in `folder` (for a base model of `config`) written to `path` as
    convert_lora_to_gguf.py writes it; alpha is the folder's lora_alpha."""
    settings = json.loads((Path(folder) / "adapter_config.json").read_text())
    return write_gguf_lora_tensors(
        path, LLAMA_CPP_ARCHITECTURES[config.architecture], gguf_lora_tensors(config, folder),
        settings["lora_alpha"], tensor_type,
    )  # fmt: skip
