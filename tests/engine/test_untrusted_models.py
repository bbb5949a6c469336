"""A model folder is data, never code: pickled weights are refused unread, and a folder's own
Python (config or tokenizer `auto_map`) is never imported, even on a terminal where transformers
would otherwise ask. Each case plants a file that would leave a marker behind if it ran."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from pagedserve.engine import LLM
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.engine.models.tokenizer import load_tokenizer
from pagedserve.server.cli import build_parser


class _Payload:
    """Unpickling this creates `marker` (what a malicious pytorch_model.bin could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _code_that_marks(marker: Path) -> str:
    return f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"


def test_pickled_weights_are_refused_unread(tiny_llama_dir, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in .*only safetensors"):
        LLM(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=8)
    assert not marker.exists()


def test_a_config_asking_for_its_own_model_code_is_refused(tiny_llama_dir, tmp_path):
    folder = tmp_path / "custom-model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        architectures=["EvilForCausalLM"],
        model_type="evil",
        auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "imported"
    (folder / "modeling_evil.py").write_text(_code_that_marks(marker))
    with pytest.raises(ValueError, match="EvilForCausalLM"):
        resolve_model(str(folder))
    assert not marker.exists()


def test_a_tokenizer_asking_for_its_own_code_is_refused(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models

    folder = tmp_path / "custom-tokenizer"
    folder.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(folder / "tokenizer.json")
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
            }
        )
    )
    marker = tmp_path / "imported"
    (folder / "tokenization_evil.py").write_text(_code_that_marks(marker))
    # As on a terminal: transformers would ask "Do you wish to run the custom code? [y/N]".
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    with pytest.raises(ValueError, match=r"needs Python code of its own \(auto_map\), which "):
        load_tokenizer(folder)
    assert not marker.exists()


def test_the_server_binds_to_this_machine_only_by_default():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
