"""`python -m benchmarks.quantized_cpu --part matmul` runs whole on the real SmolLM2 Q4_1
file: one JSON line per row count, timing the same 121 weights (30 layers' stacked q/k/v, o,
gate/up and down, and the tied embedding) through each route, in float32 (the block dot products
where the CPU level has them). And the agreement part's top-1 of a position, as greedy picks it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedserve.engine.frontend.outputs import Logprob, greedy_top
from pagedserve.engine.models.quantized_linear import block_dot_isa

ROOT = Path(__file__).resolve().parents[2]


def test_matmul_part_times_every_kept_weight_by_rows():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.quantized_cpu", "--part", "matmul",
         "--rows", "1", "40", "--iters", "1", "--dtype", "float32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["rows"], r["weights"], r["dtype"]) for r in records] == [
        (1, 121, "float32"),
        (40, 121, "float32"),
    ]
    keys = {"dequantized_dense_ms", "dense_ms", "used_ms"} | (
        {"block_dot_ms"} if block_dot_isa() else set()
    )
    for record in records:
        assert keys <= record.keys() and all(record[k] > 0 for k in keys)


def test_teacher_forced_top1_takes_the_lowest_id_of_tied_tokens_as_greedy_does():
    # The scored token first, as the engine lists it; tied with the top one (both rank 1).
    assert greedy_top({812: Logprob(-0.7, 1, "a"), 95: Logprob(-0.7, 1, "b")}) == 95
    assert greedy_top({95: Logprob(-0.7, 1, "b"), 812: Logprob(-0.7, 1, "a")}) == 95
    assert greedy_top({812: Logprob(-1.2, 2, "a"), 95: Logprob(-0.4, 1, "b")}) == 95
    assert greedy_top({95: Logprob(-0.4, 1, "b")}) == 95  # the scored token is the top one
