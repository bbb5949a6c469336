"""`python -m pagedserve.bench.quantized_cpu --part matmul` runs whole on the real SmolLM2 Q4_1
file: one JSON line per row count, timing the same 121 weights (30 layers' stacked q/k/v, o,
gate/up and down, and the tied embedding) through each kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedserve.engine.models.quantized_linear import compiled_gemm

ROOT = Path(__file__).resolve().parents[2]


def test_matmul_part_times_every_kept_weight_by_rows():
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.bench.quantized_cpu", "--part", "matmul",
         "--rows", "1", "9", "--iters", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["rows"], r["weights"]) for r in records] == [(1, 121), (9, 121)]
    keys = {"int_kernel_ms", "dense_bf16_ms", "used_ms"} | (
        {"compiled_gemm_ms"} if compiled_gemm() else set()
    )
    for record in records:
        assert keys <= record.keys() and all(record[k] > 0 for k in keys)
