"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors; a pickled
adapter_model.bin is refused unread, as pickled model weights are).

Only plain LoRA is served: y += scale * B @ A @ x on the decoder layers' linear projections.
Everything PEFT can save beyond that changes the model in ways the LoRA kernels cannot express
(DoRA's magnitudes, biases, whole saved modules, new token embeddings, per-module ranks), so it
is refused here, by the adapter_config.json fields PEFT writes and by the tensors themselves,
rather than served as a silently different model. The checks against the base model's shapes
are `adapter.build_adapter`'s, shared with the GGUF reader.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pagedserve.engine.lora.adapter import (
    UNSUPPORTED_REMEDY,
    FoundLoRA,
    LoRAAdapter,
    build_adapter,
    rank_refusal,
    refusal,
    unknown_modules_refusal,
)
from pagedserve.engine.models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json fields that turn on what plain LoRA is not (a truthy value refuses). The
# variants are the fields peft itself marks `is_lora_variant`, plus its other changes to the math.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_qalora": "QALoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "lora_bias": "a bias on LoRA's B (lora_bias)",
    "fan_in_fan_out": "transposed weights (fan_in_fan_out)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "LoRA on parameters such as stacked experts (target_parameters)",
}
# Fields that save embeddings or whole modules: new tokens, or a resized vocabulary.
_EMBEDDING_FIELDS = ("modules_to_save", "trainable_token_indices")
# Names of embedding (and output embedding) modules in PEFT keys and target lists.
_EMBEDDING_RE = re.compile(r"embed_tokens|lm_head|embedding|wte|trainable_tokens")
# Parts of a multimodal checkpoint that pagedserve does not run (it serves the language model
# alone): LoRA there does not change the text model, so it is skipped.
_SKIPPED_PARTS = ("vision_tower.", "vision_model.", "multi_modal_projector.", "audio_tower.")
# `<module path>.lora_A.weight`, also with the adapter's name before `.weight` (older saves).
_LORA_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
# The layer and the module path inside it; greedy, so any prefix before `layers.` is dropped.
_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<path>.+)$")


def read_peft_adapter(folder: Path, config: ModelConfig, max_rank: int, name: str) -> LoRAAdapter:
    """A PEFT folder as `adapter.load_adapter` returns it (see there)."""
    settings = _read_settings(folder, name)
    _check_settings(settings, folder, name)
    rank = settings["r"]
    if rank > max_rank:
        raise rank_refusal(name, folder, rank, max_rank)
    _check_folder(folder, config, name)
    alpha = float(settings.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    found = FoundLoRA(_lora_tensors(folder, config, name), rank, scale)
    return build_adapter(found, config, max_rank, name, folder)


def _read_settings(folder: Path, name: str) -> dict[str, Any]:
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise refusal(
            name, folder, f"the folder has no {CONFIG_FILE}",
            "give the folder PEFT's save_pretrained wrote (or a llama.cpp LoRA .gguf file)",
        )  # fmt: skip
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"{CONFIG_FILE} is unreadable ({e})"
        raise refusal(name, folder, problem, "fix or replace it") from e
    rank = settings.get("r") if isinstance(settings, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise refusal(name, folder, f"{CONFIG_FILE} has no positive rank r", "fix or replace it")
    return settings


def _check_settings(settings: dict[str, Any], folder: Path, name: str) -> None:
    peft_type = settings.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        problem = f"its peft_type is {peft_type}; only LoRA adapters are supported"
        raise refusal(name, folder, problem, UNSUPPORTED_REMEDY)
    used = [what for field, what in _UNSUPPORTED_FIELDS.items() if settings.get(field)]
    if settings.get("bias", "none") != "none":
        used.append(f"trained biases (bias={settings['bias']!r})")
    if used:
        problem = f"it uses {', '.join(used)}, which pagedserve does not support"
        raise refusal(name, folder, problem, UNSUPPORTED_REMEDY)
    saved = {field: settings[field] for field in _EMBEDDING_FIELDS if settings.get(field)}
    targets = settings.get("target_modules")
    target_list = [targets] if isinstance(targets, str) else list(targets or [])
    embeddings = [t for t in target_list if _EMBEDDING_RE.search(t)]
    if embeddings:
        saved["target_modules"] = embeddings
    if saved:
        listed = "; ".join(f"{field}: {value}" for field, value in saved.items())
        problem = (
            f"it changes embeddings or whole modules ({listed}); adapters that add tokens or "
            "change embeddings are not supported"
        )
        raise refusal(name, folder, problem, UNSUPPORTED_REMEDY)


def _check_folder(folder: Path, config: ModelConfig, name: str) -> None:
    """New tokens show in the folder's files, whatever the config says."""
    if (folder / "new_embeddings.safetensors").exists():
        problem = (
            "it holds new_embeddings.safetensors (embeddings of added tokens); adapters that "
            "add tokens are not supported"
        )
        raise refusal(name, folder, problem, UNSUPPORTED_REMEDY)
    num_tokens = _tokenizer_size(folder)
    if num_tokens is not None and num_tokens > config.vocab_size:
        problem = (
            f"its tokenizer has {num_tokens} tokens, more than this model's vocabulary of "
            f"{config.vocab_size}; adapters that add tokens are not supported"
        )
        raise refusal(name, folder, problem, UNSUPPORTED_REMEDY)


def _tokenizer_size(folder: Path) -> int | None:
    """One past the highest token id of a tokenizer saved in the folder (None: none saved)."""
    ids: list[int] = []
    for file, read in (
        ("tokenizer.json", _tokenizer_json_ids),
        ("added_tokens.json", lambda d: list(d.values())),
        ("tokenizer_config.json", lambda d: [int(i) for i in d.get("added_tokens_decoder", {})]),
    ):
        path = folder / file
        if path.is_file():
            try:
                ids += [int(i) for i in read(json.loads(path.read_text(encoding="utf-8")))]
            except (OSError, ValueError, TypeError, AttributeError):
                continue  # not a file this check understands: the tensors' checks still apply
    return max(ids) + 1 if ids else None


def _tokenizer_json_ids(data: dict[str, Any]) -> list[int]:
    vocab = data.get("model", {}).get("vocab") or {}
    # A Unigram vocabulary is a list of [piece, score]: ids are positions.
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
    return ids + [t["id"] for t in data.get("added_tokens", [])]


def _load_state_dict(folder: Path, name: str) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = (folder / f for f in WEIGHT_FILES)
    if not safetensors_file.is_file() and bin_file.is_file():
        # As for models: adapter folders are data, never code; a pickle is not read at all.
        raise refusal(
            name, folder, f"its weights are a pickle ({WEIGHT_FILES[1]}), which is not read",
            "save the adapter with safetensors (PEFT's save_pretrained does by default)",
        )  # fmt: skip
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(safetensors_file, device="cpu")
    except Exception as e:  # a truncated or foreign file: say which, whatever the library raised
        problem = f"its weights are unreadable ({e})"
        raise refusal(name, folder, problem, "fix or replace them") from e
    raise refusal(
        name, folder, f"the folder has no weights ({WEIGHT_FILES[0]})",
        "give the folder PEFT's save_pretrained wrote",
    )  # fmt: skip


def _lora_tensors(
    folder: Path, config: ModelConfig, name: str
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """(layer, module name) -> (A, B) of every LoRA pair in the weights."""
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    outside_layers: set[str] = set()
    for key, tensor in _load_state_dict(folder, name).items():
        if _in_skipped_part(key):
            continue
        module, ab = _parse_key(key, folder, name)
        m = _LAYER_RE.match(module)
        if m is None:
            outside_layers.add(module)
            continue
        layer, path = int(m["layer"]), m["path"]
        if "experts." in f"{path}." or path.endswith((".gate", ".router")):
            problem = (
                f"it targets {path} of layer {layer}; LoRA on the experts and routers of a "
                "mixture of experts is not supported"
            )
            raise refusal(name, folder, problem, "use an adapter that targets attention only")
        halves.setdefault((layer, path.rsplit(".", 1)[-1]), {})[ab] = tensor.to(torch.float32)
    if outside_layers:
        # GPT-2's transformer.h.0.attn.c_attn, ...: named once for all layers.
        paths = {
            re.sub(r"\.\d+\.", ".N.", m.removeprefix("base_model.model.")) for m in outside_layers
        }
        raise unknown_modules_refusal(paths, config, name, folder)
    return {key: _pair(key, ab, folder, name) for key, ab in halves.items()}


def _in_skipped_part(key: str) -> bool:
    return any(part in key for part in _SKIPPED_PARTS)


def _parse_key(key: str, folder: Path, name: str) -> tuple[str, str]:
    """(module path, "A" or "B") of a LoRA weight; refuses anything else."""
    m = _LORA_KEY_RE.match(key)
    if m is not None and not _EMBEDDING_RE.search(m["module"]):
        return m["module"], m["ab"]
    if _EMBEDDING_RE.search(key):
        what = f"embedding weights ({key}); adapters that add tokens or change embeddings"
    elif "lora_magnitude_vector" in key:
        what = f"DoRA magnitudes ({key}); DoRA adapters"
    else:
        what = f"a tensor that is not a LoRA A or B ({key}); such adapters"
    raise refusal(name, folder, f"its weights hold {what} are not supported", UNSUPPORTED_REMEDY)


def _pair(
    key: tuple[int, str], ab: dict[str, Tensor], folder: Path, name: str
) -> tuple[Tensor, Tensor]:
    if set(ab) != {"A", "B"}:
        layer, module = key
        problem = f"layer {layer}'s {module} has lora_{next(iter(ab))} without its other half"
        raise refusal(name, folder, problem, "save the adapter again")
    return ab["A"], ab["B"]
