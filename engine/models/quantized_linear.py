"""Matmul weights kept quantized on CPU: a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and
Q4_K / Q5_K / Q6_K weights kept as the file's own blocks, instead of dequantized to the model's
dtype at load (`--quantization`).

A decode step of one stream reads every weight once for one row of activations, so its time is
the weights' bytes: Q4_1 is 5 bits a value against bfloat16's 16 and float32's 32. The blocks are
the file's blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K with their rows interleaved by 8,
`QuantizedRows.interleave`), so the weights hold exactly the values llama.cpp multiplies by and
their memory is about the file's size, and the matmuls read them directly
(kernels/csrc/cpu_gguf.cpp, on every x86 CPU with AVX2).

By default every step multiplies by the blocks (`route`): each activation row is quantized alone
per block of 32 to 15-bit codes and each block's product is integer dot products (AVX-VNNI /
AVX512-VNNI `vpdpbusd`, else AVX2 `vpmaddubsw`), so a row's result is the same in a step of any
rows. `PAGEDSERVE_BATCH_VARIANT=1` (kernels/cpu_features.py) brings back the faster routes whose
results depend on the step's rows: bfloat16 steps of more rows on CPUs with AMX multiply tiles
of weight rows dequantized in the core's caches by AMX's bf16 tiles (`AMX_MIN_ROWS`,
`AMX_MAX_ROWS`), and other long steps dequantize each weight into a scratch buffer, a slab of rows
at a time, for oneDNN / MKL (docs/benchmarks-history.md, "One request, one answer").

A fused weight (q/k/v, gate/up) whose parts come in different block types (llama.cpp's Q4_K_M
files store some layers' v in Q8_0 beside q and k in Q5_0) keeps each run of one type as a part
and multiplies them into their own columns of the output.

Activations are float32 or bfloat16, whichever the model runs in. Other quantization types
(Q2_K, Q3_K, the IQ types), other devices, tensor parallelism, and CPUs or builds without the
block kernels (no AVX2, no C++ compiler) dequantize at load, as with `--quantization none`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.engine_config import QUANTIZATIONS
from pagedserve.engine.models.row_groups import (
    GROUP_ROWS,
    K_QUANT_GROUPS,
    fifth_bits,
    fifth_bits_back,
)
from pagedserve.kernels import cpu_features

_Q = gguf.GGMLQuantizationType
# The block types the kernels multiply by (kernels/csrc/cpu_gguf.cpp): a row holds whole blocks of
# gguf.GGML_QUANT_SIZES[type][0] values (32, or a K-quant's 256).
KEPT_TYPES = (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# Steps of at most this many rows multiply by the blocks, more rows dequantize and run a dense GEMM:
# where the two cross on the 2-core dev VMs, by activation dtype (docs/benchmarks-history.md,
# "Quantized weights on every x86 CPU"). Interleaved rows would cross later (float32: past 128
# rows), but longer steps keep their activations unquantized (docs/benchmarks-history.md, "Rows
# interleaved by 8").
BLOCK_DOT_MAX_ROWS = {torch.bfloat16: 16, torch.float32: 32}
# With AMX, bfloat16 steps of more than AMX_MIN_ROWS (weights of interleaved rows: more than
# INTERLEAVED_AMX_MIN_ROWS, where their block dot products cross) and up to AMX_MAX_ROWS rows take
# the AMX tiles (where they beat the block dot products and the dense route:
# docs/benchmarks-history.md).
AMX_MIN_ROWS = 6
INTERLEAVED_AMX_MIN_ROWS = 12
AMX_MAX_ROWS = 512
# The dense route dequantizes a weight in slabs of at most this many bytes (a tied embedding of
# 49152 x 576 would otherwise need 113 MB of float32 at once).
SCRATCH_BYTES = 8 << 20

_QUANTIZED = "_pagedserve_quantized"
logger = logging.getLogger(__name__)


# Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights of whole groups of 8 rows are kept with their rows
# interleaved by 8 (`QuantizedRows.interleave`): the block dot products then take 8 rows per
# instruction, about a third of the instructions per row and block of the file's layout
# (docs/benchmarks-history.md, "Rows interleaved by 8"). The kernels know such a weight by its type
# id plus ROWS8 (kRows8 in cpu_gguf.cpp).
INTERLEAVED_TYPES = (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q8_0, _Q.Q4_K, _Q.Q6_K)
ROWS8 = 1000


@dataclass
class QuantizedRows:
    """Rows of one GGUF weight as its blocks: `blocks` uint8 [N, K / 32 * block bytes], row n
    the blocks of the weight's row n; or, `interleaved`, [N / 8, 8 x a row's bytes]: per group
    of 8 rows and block, the 8 rows' float16 d (Q4_1: then their 8 m; Q5_0: then 32 bytes of
    fifth bits, row_groups.py), then runs of 32 bytes (Q4, Q5_0: 4, Q8_0: 8), run g holding each
    row's code bytes 4 g .. 4 g + 3 in row order (Q8_0's int8 codes stored plus 128, for the
    unsigned side of vpdpbusd). The K-quants' groups hold each block's scales and codes apart
    (row_groups.py: Q4_K 1184 bytes a super-block against the file's 1152, Q6_K the same)."""

    qtype: gguf.GGMLQuantizationType
    blocks: torch.Tensor
    shape: tuple[int, int]
    interleaved: bool = False

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take (ROWS8 added where the rows are interleaved)."""
        return int(self.qtype) + (ROWS8 if self.interleaved else 0)

    def interleave(self) -> QuantizedRows:
        """The same weight with its rows interleaved by 8 where its type and rows allow (Q4_0,
        Q4_1 or Q8_0, N a multiple of 8), else itself: same bytes, another order."""
        n, k = self.shape
        if self.interleaved or self.qtype not in INTERLEAVED_TYPES or n % GROUP_ROWS:
            return self
        if self.qtype in K_QUANT_GROUPS:
            blocks = torch.from_numpy(K_QUANT_GROUPS[self.qtype][0](self.blocks.numpy(), n, k))
            return QuantizedRows(self.qtype, blocks, self.shape, interleaved=True)
        halves, runs, bias = self._layout()
        size = gguf.GGML_QUANT_SIZES[self.qtype][1]
        g, nb = n // GROUP_ROWS, k // 32
        a = self.blocks.numpy().reshape(g, GROUP_ROWS, nb, size).transpose(0, 2, 1, 3)
        scales = [a[..., 2 * h : 2 * h + 2].reshape(g, nb, 16) for h in range(halves)]
        if self.qtype == _Q.Q5_0:  # d, 4 bytes of fifth bits, then Q4_0's 16 bytes of nibbles
            scales.append(fifth_bits(a[..., 2:6]))
            a = a[..., 4:]
        codes = a[..., 2 * halves :].reshape(g, nb, GROUP_ROWS, runs, 4).transpose(0, 1, 3, 2, 4)
        grouped = np.concatenate([*scales, codes.reshape(g, nb, 32 * runs) ^ bias], axis=-1)
        blocks = torch.from_numpy(np.ascontiguousarray(grouped).reshape(g, -1))
        return QuantizedRows(self.qtype, blocks, self.shape, interleaved=True)

    def _layout(self) -> tuple[int, int, int]:
        """An interleaved block's float16 values per row (d, and Q4_1's m), its runs of 32 code
        bytes, and what its code bytes are XORed with (Q8_0's: 0x80, plus 128)."""
        q8 = self.qtype == _Q.Q8_0
        return (2 if self.qtype == _Q.Q4_1 else 1), (8 if q8 else 4), (0x80 if q8 else 0)

    def in_file_order(self) -> np.ndarray:
        """The blocks as the file stores them, [N, K / 32 * block bytes] (interleave undone)."""
        if not self.interleaved:
            return self.blocks.numpy()
        if self.qtype in K_QUANT_GROUPS:
            return K_QUANT_GROUPS[self.qtype][1](self.blocks.numpy(), *self.shape)
        halves, runs, bias = self._layout()
        size = gguf.GGML_QUANT_SIZES[self.qtype][1]
        n, nb = self.shape[0], self.shape[1] // 32
        x = self.blocks.numpy().reshape(n // GROUP_ROWS, nb, GROUP_ROWS * size)
        lead = x.shape[:2]
        scales = [x[..., 16 * h : 16 * h + 16].reshape(*lead, GROUP_ROWS, 2) for h in range(halves)]
        if self.qtype == _Q.Q5_0:
            scales.append(fifth_bits_back(x[..., 16:48]))
            x = x[..., 32:]
        codes = (x[..., 16 * halves :] ^ bias).reshape(*lead, runs, GROUP_ROWS, 4)
        codes = codes.transpose(0, 1, 3, 2, 4).reshape(*lead, GROUP_ROWS, 4 * runs)
        rows = np.concatenate([*scales, codes], axis=-1)
        return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(n, nb * size)

    def row_blocks(self, start: int, end: int) -> torch.Tensor:
        """The blocks of rows start..end-1 (multiples of 8 where interleaved)."""
        if not self.interleaved:
            return self.blocks[start:end]
        if start % GROUP_ROWS or end % GROUP_ROWS:
            raise ValueError(f"rows {start}..{end} of interleaved blocks must be whole groups of 8")
        return self.blocks[start // GROUP_ROWS : end // GROUP_ROWS]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the values gguf.quants.dequantize gives."""
        values = gguf.quants.dequantize(self.in_file_order(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def select_rows(self, fn) -> QuantizedRows:
        """The same weight with `fn` (a numpy function of an array's rows, such as the q/k
        unpermutation) applied to its rows, in the file's layout."""
        blocks = torch.from_numpy(np.ascontiguousarray(fn(self.in_file_order())))
        return QuantizedRows(self.qtype, blocks, self.shape)

    @staticmethod
    def stack(parts: list[QuantizedRows]) -> list[QuantizedRows]:
        """Rows of several weights stacked in order (a fused q/k/v or gate/up weight): each run of
        parts of one block type joined into one (in the file's layout where joined)."""
        runs: list[list[QuantizedRows]] = []
        for part in parts:
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        return [
            run[0]
            if len(run) == 1
            else QuantizedRows(
                run[0].qtype,
                torch.cat([torch.from_numpy(p.in_file_order()) for p in run]),
                (sum(p.shape[0] for p in run), run[0].shape[1]),
            )
            for run in runs
        ]


def gguf_rows(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedRows:
    """A tensor's blocks (a GGUFReader tensor's `data`, of one of KEPT_TYPES) as the rows of an
    [N, K] weight, copied out of the file's memory map."""
    if qtype not in KEPT_TYPES:
        raise ValueError(
            f"{qtype.name} weights are not kept quantized; kept: "
            + ", ".join(t.name for t in KEPT_TYPES)
        )
    n, k = shape
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if k % values:
        raise ValueError(f"a {qtype.name} weight needs K divisible by {values}, got {shape}")
    row_bytes = k // values * nbytes
    blocks = np.array(np.asarray(data, dtype=np.uint8).reshape(n, row_bytes), copy=True)
    return QuantizedRows(qtype, torch.from_numpy(blocks), (n, k))


@functools.cache
def block_dot_isa() -> str:
    """The instructions the block matmuls run on here ("AVX2 vpmaddubsw", ...), or "" where they
    do not run: the CPU level allows them (`kernels/cpu_features.py` `block_dot_allowed`: avx2
    and above) and the loaded kernel library has them (a C++ compiler, or a prebuilt library)."""
    from pagedserve.kernels import cpu_features, cpu_ops

    if not (cpu_features.block_dot_allowed() and cpu_ops.available()):
        return ""
    return str(block_ops().block_dot_isa())


@functools.cache
def amx_tiles() -> bool:
    """Whether bfloat16 steps of several rows multiply by AMX tiles here: the block matmuls run
    (`block_dot_isa`) and the library was built with AMX (natively, on a CPU with AMX-BF16) and
    Linux granted the process the tiles."""
    from pagedserve.kernels import cpu_ops

    return bool(block_dot_isa()) and cpu_ops.amx_tiles()


@functools.cache
def block_ops():
    """The kernel library's ops, loaded on first use (`kernels/cpu_ops.py`)."""
    from pagedserve.kernels import cpu_ops

    if not cpu_ops.available():
        raise RuntimeError(
            "pagedserve's CPU kernels did not load (the warning above says why): weights kept "
            "quantized need them; use --quantization none"
        )
    return torch.ops.pagedserve_cpu


def route(rows: int, dtype: torch.dtype, interleaved: bool = False) -> str:
    """How a step of `rows` activation rows in `dtype` multiplies by kept weights here: "amx"
    (AMX tiles), "blocks" (the blocks' integer dot products) or "dense" (dequantized).
    `interleaved`: weights whose rows are all interleaved by 8. By default every step takes the
    blocks, so a row's result never depends on the step's rows; the AMX tiles and the dense
    route only with `cpu_features.batch_variant`."""
    if not cpu_features.batch_variant():
        return "blocks" if block_dot_isa() else "dense"
    amx_min = INTERLEAVED_AMX_MIN_ROWS if interleaved else AMX_MIN_ROWS
    if dtype == torch.bfloat16 and amx_min < rows <= AMX_MAX_ROWS and amx_tiles():
        return "amx"
    if rows <= BLOCK_DOT_MAX_ROWS[dtype] and block_dot_isa():
        return "blocks"
    return "dense"


_scratch: dict[torch.dtype, torch.Tensor] = {}


def _scratch_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] buffer of the process's one scratch tensor per dtype (the engine runs one
    forward pass at a time), grown as needed: no page faults of a fresh allocation per step."""
    buffer = _scratch.get(dtype)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _scratch[dtype] = torch.empty(rows * cols, dtype=dtype)
    return buffer[: rows * cols].view(rows, cols)


class BlockWeight:
    """A [N, K] matmul weight as a GGUF file's blocks, with `linear`, `embedding` (a tied
    embedding's lookups) and `dequantize`: the rows of one or more parts (`QuantizedRows.stack`),
    each of one block type."""

    def __init__(self, parts: QuantizedRows | list[QuantizedRows]) -> None:
        parts = [parts] if isinstance(parts, QuantizedRows) else list(parts)
        self.parts = [p.interleave() for p in parts]
        if not self.parts or len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError("a block weight needs one or more parts of the same K")
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        # Each part's first output column.
        self._starts = [sum(p.shape[0] for p in self.parts[:i]) for i in range(len(self.parts))]
        self.kinds = [p.qtype.name for p in self.parts]
        self.interleaved = all(p.interleaved for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.nbytes for p in self.parts)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for float32 or bfloat16 x of shape [rows, K]; with
        `float_out`, in float32 whatever x's dtype (the block dots write their float32 sums
        straight out, where a bfloat16 result would be rounded and converted back)."""
        if x.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"quantized weights multiply float32 or bfloat16, got {x.dtype}")
        x = x.contiguous()
        way = route(x.shape[0], x.dtype, self.interleaved)
        if way == "blocks":
            out_dtype = torch.float32 if float_out else x.dtype
            y = self._by_parts(x, block_ops().gguf_block_linear, out_dtype)
        else:
            if way == "amx":
                y = self._by_parts(x, block_ops().gguf_amx_linear, x.dtype)
            else:
                y = self._dense_linear(x)
            y = y.float() if float_out else y
        return y if bias is None else y.add_(bias)

    def _by_parts(self, x: torch.Tensor, op, out_dtype: torch.dtype) -> torch.Tensor:
        """x @ W^T by `op` (x, blocks, qtype, out), each part into its own columns."""
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        for part, start in zip(self.parts, self._starts, strict=True):
            op(x, part.blocks, part.kernel_type, y[:, start : start + part.shape[0]])
        return y

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through the weight dequantized, a slab of rows at a time."""
        slab = max(1, SCRATCH_BYTES // (self.in_features * x.element_size()))
        slab = max(GROUP_ROWS, slab // GROUP_ROWS * GROUP_ROWS)  # whole groups of interleaved rows
        if len(self.parts) == 1 and self.out_features <= slab:
            return F.linear(x, self._dequantize_into(self.parts[0], 0, self.out_features, x.dtype))
        y = x.new_empty(x.shape[0], self.out_features)
        for part, offset in zip(self.parts, self._starts, strict=True):
            for start in range(0, part.shape[0], slab):
                end = min(part.shape[0], start + slab)
                y[:, offset + start : offset + end] = F.linear(
                    x, self._dequantize_into(part, start, end, x.dtype)
                )
        return y

    def _dequantize_into(
        self, part: QuantizedRows, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        out = _scratch_rows(end - start, self.in_features, dtype)
        block_ops().gguf_block_dequantize(part.row_blocks(start, end), part.kernel_type, out)
        return out

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (a tied embedding's lookup, one part) in `dtype`."""
        (part,) = self.parts
        flat = ids.reshape(-1).long().contiguous()
        out = torch.empty(flat.numel(), self.in_features, dtype=dtype)
        block_ops().gguf_block_dequantize(part.blocks, part.kernel_type, out, flat)
        return out.view(*ids.shape, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: the values the matmuls multiply by (for tests and references)."""
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        for part, start in zip(self.parts, self._starts, strict=True):
            view = out[start : start + part.shape[0]]
            block_ops().gguf_block_dequantize(part.blocks, part.kernel_type, view)
        return out


def attach(param: torch.nn.Parameter, weight: BlockWeight) -> None:
    """Make `weight` the parameter's matmul weight and free the dense values: the parameter keeps
    its dtype but holds no elements (`quantized(param)` finds the weight)."""
    setattr(param, _QUANTIZED, weight)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def quantized(param: torch.Tensor) -> BlockWeight | None:
    return getattr(param, _QUANTIZED, None)


def weight_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    return rows * cols * (torch.finfo(dtype).bits // 8)


def describe(weights: list[BlockWeight], dtype: torch.dtype) -> str:
    """One log line: how many weights (parts of a fused weight apart) are kept in which block
    type, their bytes against `dtype`, and the instructions their matmuls run on."""
    kept = sum(w.nbytes for w in weights)
    dense = sum(weight_bytes(w.out_features, w.in_features, dtype) for w in weights)
    parts = [kind for w in weights for kind in w.kinds]
    counts = ", ".join(f"{parts.count(kind)} {kind}" for kind in sorted(set(parts)))
    interleaved = all(w.interleaved for w in weights)
    by_blocks = f"multiply by the blocks ({block_dot_isa()}" + (
        ", rows interleaved by 8)" if interleaved else ")"
    )
    if not cpu_features.batch_variant():
        routes = f"steps of any rows {by_blocks}, each row's result its own"
    elif dtype == torch.bfloat16 and amx_tiles():
        amx_min = INTERLEAVED_AMX_MIN_ROWS if interleaved else AMX_MIN_ROWS
        routes = (
            f"steps of up to {amx_min} rows {by_blocks}, up to {AMX_MAX_ROWS} by AMX bf16 tiles "
            "of weights dequantized in cache, longer ones by the weights dequantized"
        )
    else:
        routes = (
            f"steps of up to {BLOCK_DOT_MAX_ROWS[dtype]} rows {by_blocks}, longer ones by the "
            "weights dequantized"
        )
    return (
        f"quantized matmul weights kept as the GGUF file's blocks ({counts}): "
        f"{kept / 2**20:.1f} MiB instead of {dense / 2**20:.1f} MiB in "
        f"{str(dtype).removeprefix('torch.')} ({dense / max(kept, 1):.1f}x less); {routes}"
    )


def keep_quantized(
    quantization: str, source_kind: str, device: torch.device, dtype: torch.dtype, sharded: bool
) -> bool:
    """Whether the engine keeps a model's quantized weights quantized (`--quantization`).

    auto: yes for a GGUF file run in float32 or bfloat16 on a CPU with the block matmuls, without
    tensor parallelism, else dequantize at load; none: dequantize at load; gguf: keep them, and a
    ValueError saying what to change where that cannot be done."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return False
    problems = []
    if source_kind != "gguf":
        problems.append("the model is not a GGUF file")
    if device.type != "cpu":
        problems.append(f"quantized matmuls run on CPU, the device is {device}")
    if dtype not in ACTIVATION_DTYPES:
        problems.append(f"they multiply float32 or bfloat16 activations, the dtype is {dtype}")
    if sharded:
        problems.append("tensor parallelism slices dequantized weights")
    if device.type == "cpu" and not block_dot_isa():
        problems.append(
            "this machine has no compiled matmuls by GGUF blocks (they need a C++ compiler and "
            "an x86 CPU with AVX2)"
        )
    if quantization == "gguf" and problems:
        raise ValueError(
            "--quantization gguf cannot keep the weights quantized: "
            + "; ".join(problems)
            + " (use --quantization none, or auto to decide per run)"
        )
    return not problems
