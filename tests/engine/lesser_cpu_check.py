"""Run only by tests/engine/test_lesser_cpu.py, inside its pytest process under
PAGEDSERVE_CPU_ISA (its name keeps it out of the suite's own collection): that the process
really takes the lesser level's decisions, down to torch, oneDNN and the loaded kernel library.
It writes what it saw to $PAGEDSERVE_LESSER_CPU_REPORT (JSON) for the outer test."""

from __future__ import annotations

import json
import os

import torch

from pagedserve.engine import EngineConfig
from pagedserve.engine.models.cpu_linear import can_pack
from pagedserve.engine.models.quantized_linear import amx_tiles, block_dot_isa, keep_quantized
from pagedserve.kernels import cpu_features, cpu_ops

REPORT_ENV = "PAGEDSERVE_LESSER_CPU_REPORT"


def test_the_process_decides_as_the_lesser_cpu():
    level = os.environ[cpu_features.ISA_ENV]
    features = cpu_features.cpu_features()
    assert features.level == level and features.forced
    library = cpu_ops.loaded()
    assert library is not None and library.level == level
    assert library.march == cpu_features.march_flags(level)
    report = {
        "level": features.level,
        "detected": features.detected,
        "library": {
            "origin": library.origin,
            "level": library.level,
            "march": library.march,
            "path": str(library.path),
        },
        "block_dot_isa": block_dot_isa(),
        "amx_tiles": amx_tiles(),
        "keeps_gguf_float32": keep_quantized(
            "auto", "gguf", torch.device("cpu"), torch.float32, sharded=False
        ),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16_torch": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "packs_bf16": can_pack(torch.device("cpu"), torch.bfloat16),
        "default_dtype": str(EngineConfig().model.torch_dtype(torch.device("cpu"))),
    }
    with open(os.environ[REPORT_ENV], "w") as f:
        json.dump(report, f)
