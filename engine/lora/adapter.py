"""LoRA adapters as pagedserve's projections hold them.

The model stacks q/k/v into one `qkv` projection and gate/up into one `gate_up` projection
(engine/models/model.py); an adapter is mapped onto the same four projections per layer:

    qkv      parts (q, k, v)       out = q_size + 2 * kv_size, in = hidden
    o        one part              out = hidden, in = q_size
    gate_up  parts (gate, up)      out = 2 * intermediate, in = hidden
    down     one part              out = hidden, in = intermediate

Each part has its own A (the adapter's lora_A of that module); B's rows are the parts' lora_B
rows stacked in output order, with the scaling (alpha / r, or alpha / sqrt(r) for rsLoRA)
folded in. A part the adapter does not target is zeros.

`load_adapter` reads an adapter into this layout from a PEFT folder or a llama.cpp LoRA .gguf
file, and refuses (ValueError) whatever the layout cannot express or the base model does not fit:
serving such an adapter anyway would answer with a different model than the one trained.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.models.model_config import ModelConfig

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def projection_parts(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """projection -> (the output size of each of its parts, its input size)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": ((q, kv, kv), h),
        "o": ((h,), q),
        "gate_up": ((inter, inter), h),
        "down": ((h,), inter),
    }


def lora_slot_bytes(config: ModelConfig, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """Device bytes of the slots: every layer's four projections (the mixture-of-experts layers'
    attention only), A and B at the largest rank, `max_loras` times."""
    parts = projection_parts(config)
    per_layer = {
        name: (len(outs) * in_features + sum(outs)) * max_rank
        for name, (outs, in_features) in parts.items()
    }
    total = 0
    for layer in range(config.num_hidden_layers):
        total += per_layer["qkv"] + per_layer["o"]
        if not config.is_moe_layer(layer):
            total += per_layer["gate_up"] + per_layer["down"]
    return total * max_loras * dtype_bytes


@dataclass
class LoRAWeights:
    """One projection of one layer: a [J, r, in] (part j's A), b [out, r] (scaled)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    # Per layer: projection name -> its weights; a projection the adapter leaves alone is absent.
    layers: list[dict[str, LoRAWeights]]
    target_modules: tuple[str, ...]  # the module names it adapts (q_proj, ..., down_proj)

    @property
    def num_bytes(self) -> int:
        return sum(
            w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
            for layer in self.layers
            for w in layer.values()
        )


# ------------------------------------------------------------------ loading
# The readers (engine/lora/peft_adapter.py, engine/lora/gguf_adapter.py) turn a file's names into
# (layer, module) pairs and leave every check against the base model to `build_adapter`, so that
# both formats are held to the same rules. They are imported only when an adapter loads: this
# module is one the API server's process may import, and the GGUF reader pulls in the weight
# loaders.

# Module name -> (projection, part); part None: a fused module covering every part of it.
_MODULES: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# Phi-3's checkpoints fuse q/k/v and gate/up into one linear each.
_PHI3_MODULES: dict[str, tuple[str, int | None]] = {
    "qkv_proj": ("qkv", None),
    "o_proj": ("o", 0),
    "gate_up_proj": ("gate_up", None),
    "down_proj": ("down", 0),
}
_MLP_PROJECTIONS = ("gate_up", "down")
# What each size is called in a mismatch message: (input of the projection, output of each part).
_SIZE_NAMES = {
    "qkv": ("hidden size", ("query size", "key size", "value size")),
    "o": ("query size", ("hidden size",)),
    "gate_up": ("hidden size", ("intermediate size", "intermediate size")),
    "down": ("intermediate size", ("hidden size",)),
}
UNSUPPORTED_REMEDY = (
    "merge it into the base model (peft's merge_and_unload, llama.cpp's llama-export-lora) and "
    "serve the merged model"
)
MISMATCH_REMEDY = "serve it with the base model it was trained for"


def family_modules(config: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """The module names a LoRA of `config`'s family may target -> (projection, part)."""
    return _PHI3_MODULES if config.architecture == "phi3" else _MODULES


def refusal(name: str, path: str | Path, problem: str, remedy: str) -> ValueError:
    """The error for an adapter that cannot be served: which one, what is wrong, what to do."""
    return ValueError(f"LoRA adapter {name!r} at {str(path)!r}: {problem}; {remedy}")


def rank_refusal(name: str, path: str | Path, rank: int, max_rank: int) -> ValueError:
    return refusal(
        name, path, f"rank {rank} exceeds --max-lora-rank {max_rank}",
        f"restart the server with --max-lora-rank {rank} or more",
    )  # fmt: skip


def load_adapter(path: str | Path, config: ModelConfig, max_rank: int, name: str) -> LoRAAdapter:
    """Read a LoRA adapter for the base model `config`: a PEFT folder (adapter_config.json and
    adapter_model.safetensors; a pickled .bin is refused unread) or a .gguf file as llama.cpp's
    convert_lora_to_gguf.py writes it. Tensors come back float32 on CPU, laid out as this
    module's docstring says.

    Raises ValueError, naming the adapter, the path and what to do, for: a missing path, or a
    folder without adapter_config.json or weights; a rank over `max_rank`; adapters that add
    tokens or change embeddings; LoRA variants and options beyond y += scale * B A x (DoRA,
    biases, fan_in_fan_out, rank/alpha patterns, ...); modules the family does not have, experts
    included; and a different base model (more layers, other sizes, another architecture).
    """
    path = Path(path)
    if config.is_encoder_decoder or config.is_encoder_only:
        problem = f"LoRA adapters are served for decoder models only, not {config.architecture}"
        raise refusal(name, path, problem, "serve the adapter with a decoder model")
    if not path.exists():
        raise refusal(
            name, path, "no such file or folder",
            "give the path of a PEFT adapter folder or of a llama.cpp LoRA .gguf file",
        )  # fmt: skip
    if path.is_file() and path.suffix == ".gguf":
        from pagedserve.engine.lora.gguf_adapter import read_gguf_adapter

        return read_gguf_adapter(path, config, max_rank, name)
    if not path.is_dir():
        raise refusal(
            name, path, "not a folder nor a .gguf file",
            "give the path of a PEFT adapter folder or of a llama.cpp LoRA .gguf file",
        )  # fmt: skip
    from pagedserve.engine.lora.peft_adapter import read_peft_adapter

    return read_peft_adapter(path, config, max_rank, name)


@dataclass
class FoundLoRA:
    """What a reader found, in the base model's terms, for `build_adapter` to check and lay out:
    (layer, module name) -> (A [r, in], B [out, r]) as stored; the rank and the scaling B gets."""

    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    scale: float


def build_adapter(
    found: FoundLoRA, config: ModelConfig, max_rank: int, name: str, path: str | Path
) -> LoRAAdapter:
    """Check `found` against the base model and lay it out per projection.

    Refuses (ValueError) modules the family does not have, layers past the model's last, MLP
    modules of a mixture-of-experts layer, a rank over `max_rank` and any size that differs from
    the model's.
    """
    if not found.tensors:
        problem = "it holds no LoRA weights for the layers of the language model"
        raise refusal(name, path, problem, "give an adapter saved after training")
    _check_modules(found, config, name, path)
    if found.rank > max_rank:
        raise rank_refusal(name, path, found.rank, max_rank)
    parts = projection_parts(config)
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(config.num_hidden_layers)]
    for (layer, module), (a, b) in sorted(found.tensors.items()):
        _check_shapes(found, config, layer, module, (name, path))
        projection, part = family_modules(config)[module]
        if projection not in layers[layer]:
            outs, size_in = parts[projection]
            layers[layer][projection] = LoRAWeights(
                a=torch.zeros(len(outs), found.rank, size_in),
                b=torch.zeros(sum(outs), found.rank),
            )
        scaled_b = b.to(torch.float32) * found.scale
        _place(layers[layer][projection], parts[projection][0], part, a, scaled_b)
    modules = tuple(sorted({module for _, module in found.tensors}))
    return LoRAAdapter(name=name, rank=found.rank, layers=layers, target_modules=modules)


def _place(
    weights: LoRAWeights, outs: tuple[int, ...], part: int | None, a: torch.Tensor, b: torch.Tensor
) -> None:
    if part is None:
        # A fused module has one A for all its outputs; every part gets a copy, and B's rows
        # split by part: B_j @ A x for each part j is exactly the fused B @ A x.
        weights.a[:] = a
        weights.b[:] = b
    else:
        start = sum(outs[:part])
        weights.a[part] = a
        weights.b[start : start + outs[part]] = b


def unknown_modules_refusal(
    modules: Iterable[str], config: ModelConfig, name: str, path: str | Path
) -> ValueError:
    known = ", ".join(family_modules(config))
    return refusal(
        name, path,
        f"it targets modules a {config.architecture} model does not have: "
        f"{', '.join(sorted(modules))} (LoRA may target {known})",
        "use an adapter trained for this model family",
    )  # fmt: skip


def _check_modules(found: FoundLoRA, config: ModelConfig, name: str, path: str | Path) -> None:
    known = family_modules(config)
    unknown = {m for _, m in found.tensors} - known.keys()
    if unknown:
        raise unknown_modules_refusal(unknown, config, name, path)
    deepest = max((layer for layer, _ in found.tensors), default=-1)
    if deepest >= config.num_hidden_layers:
        raise refusal(
            name, path,
            f"it was trained for a model with at least {deepest + 1} layers, this one has "
            f"{config.num_hidden_layers}",
            MISMATCH_REMEDY,
        )  # fmt: skip
    on_experts = sorted(
        f"layer {layer} {module}"
        for layer, module in found.tensors
        if known[module][0] in _MLP_PROJECTIONS and config.is_moe_layer(layer)
    )
    if on_experts:
        raise refusal(
            name, path,
            f"it targets MLP modules of mixture-of-experts layers ({', '.join(on_experts[:4])}"
            f"{', ...' if len(on_experts) > 4 else ''}), which have experts instead; LoRA on "
            "experts is not supported",
            "use an adapter that targets attention only",
        )  # fmt: skip


def _check_shapes(
    found: FoundLoRA, config: ModelConfig, layer: int, module: str, where: tuple[str, str | Path]
) -> None:
    """A [rank, in] and B [out, rank], with in and out the model's sizes for `module`."""
    a, b = found.tensors[layer, module]
    projection, part = family_modules(config)[module]
    outs, size_in = projection_parts(config)[projection]
    in_name, out_names = _SIZE_NAMES[projection]
    size_out = sum(outs) if part is None else outs[part]
    out_name = f"{module} output size" if part is None else out_names[part]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != found.rank or b.shape[1] != found.rank:
        problem = (
            f"layer {layer}'s {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, not "
            f"[{found.rank}, in] and [out, {found.rank}] (rank {found.rank})"
        )
        raise refusal(*where, problem, "use an adapter with one rank throughout")
    for what, size, expected in ((in_name, a.shape[1], size_in), (out_name, b.shape[0], size_out)):
        if size != expected:
            problem = f"layer {layer}'s {module} has {what} {size} vs this model's {expected}"
            raise refusal(*where, problem, MISMATCH_REMEDY)
