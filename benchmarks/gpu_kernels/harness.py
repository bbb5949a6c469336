"""What every case of the kernel benchmark shares: the setup it runs on, the report its records go
to, the timer, the check against the reference and the fields that name a case."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TextIO

import torch

from benchmarks.gpu_kernels.plans import HeadShape

BLOCK_SIZE = 16
# bf16 outputs of magnitude 2..4 have an ulp of 0.0156: two correct kernels may differ by one ulp.
ATOL = 2e-2
RTOL = 1.6e-2  # torch.testing's default for bf16
CPU_TIMING_ITERS = 3  # the interpreter is slow; the CPU timing only proves the path runs

Record = dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """What every case runs on: the module under test, the device, the dtype, the timer."""

    kernels: ModuleType
    device: torch.device
    dtype: torch.dtype
    cuda_graph: bool = False  # time attention (not the cache write) as CUDA-graph replays
    fused_kernels: ModuleType | None = None  # the fused ops under test (the "fused" scenario)
    moe_kernels: ModuleType | None = None  # the fused MoE under test (the "moe" scenario)


class Report:
    """Collects the records, prints each as a JSON line and copies it to `sink`."""

    def __init__(self, sink: TextIO | None) -> None:
        self.records: list[Record] = []
        self.failed = False
        self._sink = sink

    def emit(self, record: Record) -> None:
        self.records.append(record)
        if record["kind"] == "error" or (record["kind"] == "check" and not record["ok"]):
            self.failed = True
        line = json.dumps(record)
        print(line, flush=True)
        if self._sink is not None:
            self._sink.write(line + "\n")
            self._sink.flush()


def time_us(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median time of one call in microseconds.

    CUDA: triton's do_bench (CUDA events around each call, L2 flushed before it, default warmup
    and rep), so K/V come from HBM as in a model, where other layers' weights evict them. Host
    launch cost overlaps the flush, unless it exceeds the flush's ~70 us; with `graph`, do_bench
    times a CUDA-graph replay of `fn` instead, as the engine replays decode steps.
    CPU: wall-clock median of a few calls after one warm-up.
    """
    if device.type == "cuda":
        import triton.testing

        timed = graph_replay(fn) if graph else fn
        return float(triton.testing.do_bench(timed, return_mode="median")) * 1e3
    fn()
    samples = []
    for _ in range(CPU_TIMING_ITERS):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture one call of `fn` in a CUDA graph (after warm-up calls on a side stream, which
    compile and allocate outside the capture) and return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return cuda_graph.replay


def significant(x: float) -> float:
    """x to 4 significant digits: rates span 0.001 (CPU smoke) to 5000 (GB/s on an H200)."""
    return float(f"{x:.4g}")


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """max |got - want|, or None where either holds a NaN or an infinity (JSON has neither)."""
    err = float((got.float() - want.float()).abs().max())
    return err if math.isfinite(err) else None


def check(
    report: Report,
    label: Record,
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
    atol: float = ATOL,
    rtol: float = RTOL,
) -> None:
    """Emit one check record: ok when every element of every `got` is within atol + rtol * |want|
    (a NaN never is); max_abs_err is None when some output is not finite."""
    errors: list[float | None] = []
    ok = True
    for got, want in pairs:
        diff = (got.float() - want.float()).abs()
        ok = ok and bool((diff <= atol + rtol * want.float().abs()).all())
        errors.append(max_abs_err(got, want))
    worst = None if None in errors else max(errors)
    report.emit(
        {"kind": "check", **label, "max_abs_err": worst, "atol": atol, "rtol": rtol, "ok": ok}
    )


def case_record(scenario: str, case: str, shape: HeadShape, **fields: Any) -> Record:
    """Fields that name a case in every record about it: scenario, a short case name, the head
    shape, then the case's own sizes."""
    return {
        "scenario": scenario,
        "case": case,
        "shape": shape.name,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        **fields,
    }


def speed_fields(t: float, base_t: float, target: float | None) -> Record:
    """ratio = base_t / t, i.e. our throughput over the baseline's."""
    ratio = base_t / t
    return {
        "ratio": significant(ratio),
        "target": target,
        "ok": None if target is None else ratio >= target,
    }


def run_case(report: Report, device: torch.device, label: Record, fn: Callable[[], None]) -> None:
    """Run one case; an exception becomes an error record and the run goes on."""
    try:
        fn()
    except Exception as exc:
        report.emit({"kind": "error", **label, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
