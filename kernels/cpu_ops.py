"""The compiled CPU backend: paged attention from `kernels/csrc/cpu_attention.cpp`; RMSNorm,
residual add + RMSNorm, SiLU-and-multiply and rotary + KV write from
`kernels/csrc/cpu_layer_ops.cpp`; the other ops from `kernels.reference`.
`kernels.get_backend("cpu")` returns this module. The same library holds the GEMM for weights
kept quantized (`kernels/csrc/cpu_quant.cpp`) that `engine/quantized_linear.py` uses for steps of
many rows.

The C++ sources are compiled once per machine with the system's C++ compiler (optimised for this
CPU: -O3 -march=native, OpenMP through torch's own runtime) and cached in pagedserve's cache folder
(`kernels.paths.cache_dir()`, ~/.cache/pagedserve by default), under kernels/, in a file named by a
hash of the source, the flags, the torch version and the CPU's instruction-set flags; later
processes load it in milliseconds. With the cache turned off, each process builds into a temporary
folder.
`make install` builds it ahead of time (`python -m pagedserve.kernels.cpu_ops`). Where no
compiler is found, or the build fails, `available()` is False with one warning saying why, and the
engine's "auto" backend on CPU falls back to the torch reference.

The kernel attends to decode sequences and to extends of up to KERNEL_MAX_NEW_TOKENS new tokens;
longer prefills/extends in the same batch go to the reference's SDPA, one call per sequence,
because SDPA's GEMMs beat the kernel's dot products there (the kernel computes them correctly too:
the tests raise the limit). fp8 caches go to the reference (the kernel reads float32, bfloat16 and
float16 caches).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.kernels import reference, validation
from pagedserve.kernels.fp8 import is_fp8
from pagedserve.kernels.paths import cache_dir
from pagedserve.kernels.reference import (
    copy_blocks,
    fused_moe,
    gelu_tanh_and_mul,
    moe_route,
    reshape_and_cache,
)
from pagedserve.kernels.validation import (
    check_fused_add_rms_norm_args,
    check_paged_attention_args,
    check_rms_norm_args,
    check_rotary_and_cache_args,
    check_silu_and_mul_args,
)

__all__ = [
    "available",
    "copy_blocks",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "library_path",
    "moe_route",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    _CSRC / name for name in ("cpu_attention.cpp", "cpu_layer_ops.cpp", "cpu_quant.cpp")
)
HEADERS = (_CSRC / "cpu_math.h",)
# Measured on the 2-core dev VM (BENCHMARKS.md): the kernel is 1.6-4x faster than the reference
# for decode and still even at 4 new tokens over a 1k context; from 8 new tokens over long
# contexts, and for whole prompts, SDPA is faster.
KERNEL_MAX_NEW_TOKENS = 4
# No -ffast-math: the kernel's -inf handling needs IEEE infinities.
CXX_FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=c++17",
    "-shared", "-fPIC", "-w",
)  # fmt: skip


def _kernel_dir() -> Path:
    root = cache_dir()
    return (root if root is not None else Path(tempfile.mkdtemp(prefix="pagedserve-"))) / "kernels"


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (-march=native compiles for them), '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    """The C++ compiler: $CXX when set, else c++ / g++ / clang++ on PATH; None when absent."""
    configured = os.environ.get("CXX")
    candidates = [configured] if configured else ["c++", "g++", "clang++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def library_path() -> Path:
    """Where this machine's build of the kernel lives (built or not)."""
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(CXX_FLAGS).encode(),
                 torch.__version__.encode(), _cpu_flags().encode()):  # fmt: skip
        key.update(part)
        key.update(b"\0")
    return _kernel_dir() / f"pagedserve_cpu_{key.hexdigest()[:16]}.so"


def _build(target: Path, compiler: str) -> None:
    """Compile SOURCES into `target`, written to a temporary file and renamed, so concurrent
    builders (server processes, test workers) never load a half-written library."""
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = Path(torch.__file__).parent / "lib"
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [
        compiler, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(source) for source in SOURCES), "-o", tmp,
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip
    start = time.perf_counter()
    logger.warning(
        "compiling pagedserve's CPU kernels for this machine (once; cached in %s)",
        target.parent,
    )
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.warning("CPU kernels compiled in %.1f s", time.perf_counter() - start)


@functools.cache
def available() -> bool:
    """Whether the compiled kernel is loaded (building it first if this machine has no build).
    False, with one warning saying why, when there is no compiler or the build fails."""
    target = library_path()
    if not target.exists():
        compiler = _compiler()
        if compiler is None:
            logger.warning(
                "no C++ compiler found (set CXX, or install g++): CPU attention falls back to "
                "the slower torch reference"
            )
            return False
        try:
            _build(target, compiler)
        except (OSError, RuntimeError) as exc:
            logger.warning("CPU attention kernel not built, using the torch reference: %s", exc)
            return False
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:  # a damaged file, or one built for another torch
        logger.warning(
            "CPU attention kernel %s not loaded, using the torch reference (delete it to "
            "rebuild): %s", target, exc,
        )  # fmt: skip
        return False
    return True


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.reference.paged_attention` (same arguments and result), computed by the compiled
    kernel; fp8 caches, and machines where it is not `available()`, use the reference."""
    if is_fp8(k_cache.dtype) or not available():
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            sliding_window=sliding_window, softcap=softcap, out=out,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if validation.CHECK_ARGS:
        check_paged_attention_args(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            out, softcap, k_scale, v_scale,
        )  # fmt: skip
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = block_tables.shape[0]
    host = torch.cat([seq_lens, query_start_loc]).tolist()
    seq_lens_h, starts = host[:num_seqs], host[num_seqs:]
    q_lens = reference.check_lengths(seq_lens_h, starts, q.shape[0], block_tables, k_cache.shape[1])
    limit = KERNEL_MAX_NEW_TOKENS
    if any(n <= limit for n in q_lens):
        torch.ops.pagedserve_cpu.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale),
            sliding_window or 0, softcap or 0.0, limit, out,
        )  # fmt: skip
    for i, n in enumerate(q_lens):
        if n > limit:
            rows = slice(starts[i], starts[i + 1])
            reference.paged_attention(
                q[rows], k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1],
                query_start_loc.new_tensor([0, n]), scale, sliding_window=sliding_window,
                softcap=softcap, out=out[rows],
            )  # fmt: skip
    return out


# ---- the layer's other ops (kernels/csrc/cpu_layer_ops.cpp) --------------------------------------

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compiled(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _COMPILED_DTYPES and available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with contiguous rows (what the compiled ops take; strided rows are fine)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """`kernels.reference.rms_norm`, compiled."""
    if not _compiled(x):
        return reference.rms_norm(x, weight, eps, unit_offset=unit_offset)
    if validation.CHECK_ARGS:
        check_rms_norm_args(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.pagedserve_cpu.rms_norm(_rows(x), weight.contiguous(), eps, unit_offset, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.fused_add_rms_norm` (residual updated in place), compiled."""
    if not _compiled(x) or residual.stride(-1) != 1:
        return reference.fused_add_rms_norm(x, residual, weight, eps, unit_offset=unit_offset)
    if validation.CHECK_ARGS:
        check_fused_add_rms_norm_args(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.pagedserve_cpu.fused_add_rms_norm(
        _rows(x), residual, weight.contiguous(), eps, unit_offset, out
    )
    return out, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`kernels.reference.silu_and_mul`, compiled."""
    if not _compiled(gate_up):
        return reference.silu_and_mul(gate_up)
    if validation.CHECK_ARGS:
        check_silu_and_mul_args(gate_up)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    torch.ops.pagedserve_cpu.silu_and_mul(_rows(gate_up), out)
    return out


def rotary_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.reference.rotary_and_cache`, compiled; fp8 caches use the reference."""
    if is_fp8(k_cache.dtype) or not _compiled(qkv):
        return reference.rotary_and_cache(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads, head_dim, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if validation.CHECK_ARGS:
        check_rotary_and_cache_args(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads, head_dim, k_scale, v_scale,
        )  # fmt: skip
    q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype)
    torch.ops.pagedserve_cpu.rotary_and_cache(
        _rows(qkv), positions.contiguous(), cos_table.contiguous(), sin_table.contiguous(),
        k_cache, v_cache, slot_mapping.contiguous(), num_heads, num_kv_heads, head_dim, q,
    )  # fmt: skip
    return q


if __name__ == "__main__":  # `make install`: build ahead of time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if available() else 1)
