"""The engine's CPU paths at a lesser CPU level, on this machine: one pytest process runs a chosen
part of the suite under PAGEDSERVE_CPU_ISA=avx2, with torch's kernels and oneDNN lowered to AVX2
too (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY: kernels/cpu_features.py `emulation_env`), so that
an AVX512 machine checks what an AVX2-only CPU runs: no oneDNN bf16 packing (its reorder raises
there), GGUF weights kept quantized in float32 and multiplied by AVX2's vpmaddubsw, the C++
kernels compiled for x86-64-v3, float32 by default. Skipped where the CPU's own level is avx2 or
lower: the whole suite runs these paths natively there.

The part was chosen for what it checks per second (about 60 s in all on the 2-core dev VM, 20 s
of them the build): the decisions themselves (tests/engine/lesser_cpu_check.py), GGUF weights
kept quantized (the block matmuls without VNNI, against the reference), oneDNN packing (float32
only), the compiled kernels (paged attention, layer ops), the LoRA projections' masked path on
unpacked bf16 weights, real SmolLM2's greedy tokens equal to transformers', and one request, one
answer: each op's rows and a default server's answers the same however they are batched. The fp8 KV
cache's agreement floor was set from measurements at both levels
(tests/engine/test_kv_capacity.py) and is left to the suite's own run.

Its kernels come from a prebuilt library: `python -m pagedserve.kernels.cpu_ops --prebuilt
--levels avx2` compiles it into a copy of the kernels package, which the process imports
(PYTHONPATH) with no compiler (CXX points at nothing) and a cache that holds no avx2 build: the
test of --prebuilt, found first and loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.kernels import cpu_features, cpu_ops
from tests.engine.lesser_cpu_check import REPORT_ENV
from tests.engine.test_real_model import REFERENCE_ENV, greedy_reference

ROOT = Path(__file__).resolve().parents[2]
LEVEL = "avx2"
SUBSET = [
    "tests/engine/lesser_cpu_check.py",
    "tests/engine/test_quantized_linear.py",
    "tests/engine/test_interleaved_rows.py",
    "tests/engine/test_compiled_step.py",
    "tests/engine/test_cpu_linear.py",
    "tests/engine/test_lora_layers.py",
    "tests/kernels/test_cpu_layer_ops.py",
    "tests/kernels/test_cpu_kernel.py",
    "tests/engine/test_real_model.py::test_greedy_tokens_equal_transformers_on_the_same_gguf",
    "tests/kernels/test_batch_invariance.py",
    "tests/server/test_one_answer.py",
]
# What the part counts at avx2 (update with SUBSET): the bf16 packing tests (needs_onednn_bf16),
# the AMX route's (needs_amx: a portable build has no AMX) and the attention kernel's AMX tile
# cases skip there.
EXPECTED = "539 passed, 25 skipped"

pytestmark = pytest.mark.skipif(
    not cpu_features.cpu_features().at_least("avx512"),
    reason=f"this process's CPU level is {cpu_features.cpu_features().level}: the suite runs the "
    f"{LEVEL} paths natively here",
)


def _env(package_root: Path, **extra: str) -> dict[str, str]:
    """The environment of a process at the avx2 level that imports the kernels' copy."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_features.emulation_env(LEVEL)}
    env.update({cpu_features.ISA_ENV: LEVEL, **cpu_features.emulation_env(LEVEL), **extra})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def package_root(tmp_path_factory) -> Path:
    """A folder holding pagedserve/kernels/, a copy of the kernels package with the avx2 level's
    prebuilt library in it (`pagedserve` is a namespace package: the other subpackages still come
    from the install)."""
    root = tmp_path_factory.mktemp("package")
    kernels = root / "pagedserve" / "kernels"
    shutil.copytree(Path(cpu_ops.__file__).parent, kernels,
                    ignore=shutil.ignore_patterns("prebuilt", "__pycache__"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.kernels.cpu_ops", "--prebuilt", "--levels", LEVEL],
        env=_env(root, PAGEDSERVE_CACHE_DIR=str(root / "cache")),
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"the prebuilt library for level avx2 \(-march=x86-64-v3\), .*/pagedserve/"
        r"kernels/prebuilt/pagedserve_cpu_avx2_\w+\.so",
        done.stderr,
    ), done.stderr
    return root


def test_prebuilt_builds_each_level_asked_for_into_the_package(package_root):
    built = sorted(p.name for p in (package_root / "pagedserve/kernels/prebuilt").iterdir())
    assert len(built) == 1 and built[0].startswith("pagedserve_cpu_avx2_"), built
    assert not (package_root / "cache" / "kernels").exists()  # nothing compiled for the cache


def test_the_engine_passes_its_cpu_tests_at_the_avx2_level(package_root, tmp_path, hf_smollm2):
    report = tmp_path / "report.json"
    # transformers' side of the real model's comparison, from this process's model.
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps(greedy_reference(hf_smollm2)))
    env = _env(
        package_root, CXX=str(tmp_path / "no-compiler"),
        **{REPORT_ENV: str(report), REFERENCE_ENV: str(reference)},
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert summary.split(" in ")[0] == EXPECTED, summary
    seen = json.loads(report.read_text())
    prebuilt = package_root / "pagedserve" / "kernels" / "prebuilt"
    assert seen == {
        "level": "avx2",
        "detected": cpu_features.cpu_features().detected,
        "library": {
            "origin": "prebuilt",
            "level": "avx2",
            "march": ["-march=x86-64-v3"],
            "path": seen["library"]["path"],
        },  # fmt: skip
        "block_dot_isa": "AVX2 vpmaddubsw",  # x86-64-v3 has no VNNI: the AVX2 dot products
        "amx_tiles": False,  # a portable build has no AMX
        "keeps_gguf_float32": True,
        "aten_capability": "AVX2",
        "onednn_bf16_torch": False,
        "packs_bf16": False,
        "default_dtype": "torch.float32",
    }
    assert Path(seen["library"]["path"]).parent == prebuilt
