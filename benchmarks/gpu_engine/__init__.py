"""The engine on an H200 (correctness, decode step time, profile, offline and online throughput,
speculative decoding, ...) as steps of one script, `benchmarks/gpu_engine.sh`, which runs each step
in a fresh interpreter under its own time limit: `python -m benchmarks.gpu_engine STEP`
(`cli`: the steps, the options, what is written where).

One module per step (`env`, `correctness`, `decode`, `offline`, `nano`, `online`, `spec`, and
the optional `moe`, `structured`, `kvcap`, `tp`, `whisper`), the `summary` table of their
records, and the `harness` they share: the H200 and smoke sizes, the tiny Llama, the records,
and the helpers that build, size and time engines. Steps import torch, transformers and the
engine inside their functions, so that a step's interpreter pays only for what it uses.
"""

from __future__ import annotations

from benchmarks.gpu_engine.cli import build_parser, main
from benchmarks.gpu_engine.correctness import compare_tokens
from benchmarks.gpu_engine.harness import GPU_SIZES, SMOKE_SIZES, TINY_LLAMA, Sizes
from benchmarks.gpu_engine.summary import summarize

__all__ = [
    "GPU_SIZES",
    "SMOKE_SIZES",
    "TINY_LLAMA",
    "Sizes",
    "build_parser",
    "compare_tokens",
    "main",
    "summarize",
]
