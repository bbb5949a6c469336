"""Matmul weights kept quantized on CPU: a GGUF file's Q4_0 / Q4_1 weights as int4, its Q8_0 weights
as int8, instead of dequantized to the model's dtype at load (`--quantization`).

A decode step of one stream reads every weight once for one row of activations, so its time is
the weights' bytes: int4 is a quarter of bfloat16's. Steps of few rows (`int_kernel_max_rows`)
multiply by the quantized weight through torch's CPU kernels (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`), which unpack the weight again for every few rows; steps of more rows go to
pagedserve's compiled GEMM (kernels/csrc/cpu_quant.cpp), which dequantizes each block of 64
output features once into a bfloat16 tile and multiplies all rows by it with AVX512-BF16 dot
products, as fast as oneDNN's packed bfloat16 weights (measured: BENCHMARKS.md, "Quantized
weights on CPU").

What is kept, and how exactly:
- Q4_0 / Q4_1: GGUF's groups of 32 (value = d * code + m, Q4_0's m = -8d) are torch's int4
  groups of 32 with scale d and zero m + 8d (torch computes (code - 8) * scale + zero), stored in
  bfloat16: the only rounding is of each group's scale and zero from float16 to bfloat16.
- Q8_0: torch's int8 kernel has one scale per output feature, not per group of 32, so each row is
  requantized to int8 with scale max|row| / 127 (round to nearest): at most half a step of that
  scale from the file's values (the greedy agreement with the dequantized model is in
  BENCHMARKS.md).
Activations are bfloat16 (torch's int4 kernel is slow in float32); other dtypes, other quantization
types (K-quants), int4 weights whose output features are not a multiple of 64 and tied embeddings in
int4 (their lookups need rows) are dequantized at load, as with `--quantization none`.
"""

from __future__ import annotations

import abc
import functools
import logging
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagedserve.engine.engine_config import QUANTIZATIONS

GROUP = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block: inputs per scale
INT4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
INT8_TYPES = (gguf.GGMLQuantizationType.Q8_0,)
KEPT_TYPES = INT4_TYPES + INT8_TYPES

_QUANTIZED = "_pagedserve_quantized"
logger = logging.getLogger(__name__)


@dataclass
class QuantizedRows:
    """Rows of one GGUF weight in its quantized form: value[n, k] = scales[n, k // 32] * codes[n, k]
    + offsets[n, k // 32] (no offsets for Q8_0). codes: uint8 0..15 (int4) or int8, [N, K];
    scales and offsets: float32 [N, K / 32]."""

    kind: str  # "int4" or "int8"
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the values gguf.quants.dequantize gives, bit for bit."""
        n, k = self.codes.shape
        grouped = self.codes.float().view(n, k // GROUP, GROUP) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            grouped += self.offsets.unsqueeze(-1)
        return grouped.view(n, k)

    def select_rows(self, fn) -> QuantizedRows:
        """The same weight with `fn` (a numpy function of an array's rows, such as the q/k
        unpermutation) applied to the rows of every part."""

        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))

        return QuantizedRows(self.kind, apply(self.codes), apply(self.scales), apply(self.offsets))

    @staticmethod
    def cat(parts: list[QuantizedRows]) -> QuantizedRows:
        """Rows of several weights stacked (a fused q/k/v or gate/up weight); one kind only."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack quantized rows of kinds {sorted(kinds)}")
        offsets = [p.offsets for p in parts]
        return QuantizedRows(
            parts[0].kind,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if offsets[0] is None else torch.cat(offsets),
        )


def gguf_rows(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedRows:
    """Parse a Q4_0 / Q4_1 / Q8_0 tensor's blocks (a GGUFReader tensor's `data`) of an [N, K]
    weight. A block of 32 values holds a float16 scale d (Q4_1: then a float16 offset m) and its
    codes: Q8_0 32 int8; Q4 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31."""
    n, k = shape
    if k % GROUP:
        raise ValueError(f"a {qtype.name} weight needs K divisible by {GROUP}, got {shape}")
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // GROUP, block_bytes)

    def half(start: int) -> torch.Tensor:
        raw = np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
        return torch.from_numpy(raw.astype(np.float32))

    scales = half(0)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedRows("int8", torch.from_numpy(codes), scales, None)
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        offsets, start = scales * -8.0, 2
    elif qtype == gguf.GGMLQuantizationType.Q4_1:
        offsets, start = half(2), 4
    else:
        raise ValueError(f"{qtype.name} weights are not kept quantized; use {KEPT_TYPES}")
    qs = blocks[..., start : start + GROUP // 2]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    return QuantizedRows("int4", torch.from_numpy(codes), scales, offsets)


@functools.cache
def compiled_gemm() -> bool:
    """Whether pagedserve's compiled GEMM for quantized weights runs here (kernels/csrc/
    cpu_quant.cpp): the CPU level allows it (`kernels/cpu_features.py` `quantized_gemm_allowed`:
    AVX512-BF16) and the loaded kernel library has it (a C++ compiler, or a prebuilt library)."""
    from pagedserve.kernels import cpu_features, cpu_ops

    return (
        cpu_features.quantized_gemm_allowed()
        and cpu_ops.available()
        and bool(torch.ops.pagedserve_cpu.quantized_gemm_available())
    )


class QuantizedWeight(abc.ABC):
    """A [N, K] matmul weight in int4 or int8 with `linear`, `dequantize` and its bytes; each
    kind (Int4Weight, Int8Weight) supplies its storage and its two kernels."""

    kind: str
    out_features: int
    in_features: int
    # Steps of at most this many rows use torch's kernel, more rows the compiled GEMM (the
    # measured crossover on the 2-core dev VM, for int4 and int8 alike: BENCHMARKS.md,
    # "Quantized weights on CPU").
    int_kernel_max_rows = 8

    @staticmethod
    def supports(rows: QuantizedRows) -> bool:
        """Whether the kernels take these rows (output features divisible by 64)."""
        return rows.shape[0] % 64 == 0

    @staticmethod
    def build(rows: QuantizedRows) -> QuantizedWeight:
        if not QuantizedWeight.supports(rows):
            raise ValueError(
                f"quantized weights need output features divisible by 64, got {tuple(rows.shape)}"
            )
        return Int4Weight(rows) if rows.kind == "int4" else Int8Weight(rows)

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight holds (codes, scales and zeros)."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for bfloat16 x of shape [rows, K]."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"quantized weights multiply bfloat16 activations, got {x.dtype}")
        x = x.contiguous()
        if x.shape[0] <= self.int_kernel_max_rows or not compiled_gemm():
            y = self._int_matmul(x)
        else:
            y = x.new_empty(x.shape[0], self.out_features)
            self._gemm(x, y)
        return y if bias is None else y.add_(bias)

    @abc.abstractmethod
    def _int_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through torch's kernel for this kind (steps of few rows)."""

    @abc.abstractmethod
    def _gemm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ W^T through pagedserve's compiled GEMM (steps of many rows)."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """bfloat16 [N, K]: the values the matmuls multiply by (for tests and references)."""


class Int4Weight(QuantizedWeight):
    """Q4_0 / Q4_1 rows in torch's CPU int4 pack: half a byte per value, plus a bfloat16 scale and
    zero per group of 32 (5 bits per value in all, Q4_1's own size)."""

    kind = "int4"

    def __init__(self, rows: QuantizedRows) -> None:
        n, k = rows.shape
        self.out_features, self.in_features = n, k
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows.codes.int(), 1)
        offsets = rows.offsets if rows.offsets is not None else torch.zeros_like(rows.scales)
        zeros = offsets + 8.0 * rows.scales
        self.scale_zeros = torch.stack([rows.scales.T, zeros.T], dim=-1).bfloat16().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes

    def _int_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zeros)

    def _gemm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.pagedserve_cpu.int4pack_linear(x, self.packed, self.scale_zeros, GROUP, out)

    def dequantize(self) -> torch.Tensor:
        # (code - 8) * scale + zero per group, computed in float32 and rounded once, as the
        # kernels do.
        n, k = self.out_features, self.in_features
        identity = torch.eye(k, dtype=torch.bfloat16)
        return self._int_matmul(identity).T.contiguous().view(n, k)


class Int8Weight(QuantizedWeight):
    """Q8_0 rows requantized to one scale per output feature (torch's int8 kernel): a byte per
    value plus a bfloat16 scale per row."""

    kind = "int8"

    def __init__(self, rows: QuantizedRows) -> None:
        n, k = rows.shape
        self.out_features, self.in_features = n, k
        values = rows.dequantize()
        # The scale as stored (bfloat16) is the one the codes are rounded against.
        scales = (values.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.scales = scales.bfloat16()
        codes = torch.round(values / self.scales.float().unsqueeze(1)).clamp_(-127, 127)
        self.codes = codes.to(torch.int8)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def _int_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)

    def _gemm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.pagedserve_cpu.int8_linear(x, self.codes, self.scales, out)

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scales.unsqueeze(1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (a tied embedding's lookup), bfloat16."""
        return self.codes[ids].to(torch.bfloat16) * self.scales[ids].unsqueeze(-1)


def attach(param: torch.nn.Parameter, weight: QuantizedWeight) -> None:
    """Make `weight` the parameter's matmul weight and free the dense values: the parameter keeps
    its dtype but holds no elements (`quantized(param)` finds the weight)."""
    setattr(param, _QUANTIZED, weight)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def quantized(param: torch.Tensor) -> QuantizedWeight | None:
    return getattr(param, _QUANTIZED, None)


def weight_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    return rows * cols * (torch.finfo(dtype).bits // 8)


def describe(weights: list[QuantizedWeight], dtype: torch.dtype) -> str:
    """One log line: how many weights are kept in which kind, and their bytes against `dtype`."""
    kept = sum(w.nbytes for w in weights)
    dense = sum(weight_bytes(w.out_features, w.in_features, dtype) for w in weights)
    kinds = {kind: sum(w.kind == kind for w in weights) for kind in ("int4", "int8")}
    counts = ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
    return (
        f"quantized matmul weights kept quantized ({counts}): {kept / 2**20:.1f} MiB instead of "
        f"{dense / 2**20:.1f} MiB in {str(dtype).removeprefix('torch.')} "
        f"({dense / max(kept, 1):.1f}x less)"
    )


def keep_quantized(
    quantization: str, source_kind: str, device: torch.device, dtype: torch.dtype, sharded: bool
) -> bool:
    """Whether the engine keeps a model's quantized weights quantized (`--quantization`).

    auto: yes for a GGUF file run in bfloat16 on CPU without tensor parallelism where the compiled
    GEMM runs (without it, steps of many rows would be several times slower), else dequantize at
    load; none: dequantize at load; gguf: keep them, and a ValueError saying what to change where
    that cannot be done."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return False
    problems = []
    if source_kind != "gguf":
        problems.append("the model is not a GGUF file")
    if device.type != "cpu":
        problems.append(f"quantized matmuls run on CPU, the device is {device}")
    if dtype != torch.bfloat16:
        problems.append(f"they multiply bfloat16 activations, the dtype is {dtype}")
    if sharded:
        problems.append("tensor parallelism slices dequantized weights")
    if quantization == "gguf" and problems:
        raise ValueError(
            "--quantization gguf cannot keep the weights quantized: "
            + "; ".join(problems)
            + " (use --quantization none, or auto to decide per run)"
        )
    if problems:
        return False
    if quantization == "gguf" and not compiled_gemm():
        logger.warning(
            "no compiled GEMM for quantized weights here (it needs a C++ compiler and an "
            "AVX512-BF16 CPU): steps of many rows use torch's int4/int8 kernels, several times "
            "slower than --quantization none"
        )
    return quantization == "gguf" or compiled_gemm()
