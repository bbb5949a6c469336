"""The compiled CPU backend: paged attention from `kernels/csrc/cpu_attention.cpp`; RMSNorm,
residual add + RMSNorm, SiLU-and-multiply and rotary + KV write from
`kernels/csrc/cpu_layer_ops.cpp`; the other ops from `kernels.reference`.
`kernels.get_backend("cpu")` returns this module. The same library holds the matmuls by a GGUF
file's own blocks (`kernels/csrc/cpu_gguf.cpp`) that `engine/models/quantized_linear.py` uses for
weights kept quantized.

The C++ sources are compiled with the system's C++ compiler (OpenMP through torch's own runtime)
for the CPU level `kernels.cpu_features` chose: -march=native at the CPU's own level (fastest),
the level's portable flags (-march=x86-64-v3 ...) for a lesser one that PAGEDSERVE_CPU_ISA forced.
`available()` loads the first of:
1. a prebuilt library of the chosen level, then of each lower one, from `PREBUILT_DIR` (the
   package's prebuilt/ folder: `python -m pagedserve.kernels.cpu_ops --prebuilt` compiles one per
   x86 level there, for images built on one machine and run on others);
2. this machine's cached build, in pagedserve's cache folder (`kernels.paths.cache_dir()`,
   ~/.cache/pagedserve by default) under kernels/;
3. a build compiled now into that place (with the cache turned off: a temporary folder).
Every library's file name holds a hash of the sources, the flags and the torch version (a native
build's also of the CPU's flags), so a stale one is never loaded. `make install` builds this
machine's ahead of time (`python -m pagedserve.kernels.cpu_ops`). Whatever fails on the way (no
compiler, a source or header missing, a compile error, a damaged library) makes `available()`
False with one warning saying why: every op here then runs the torch reference, and the engine's
"auto" backend on CPU is the reference.

The kernel attends to every sequence, so that a query's result never depends on how its prompt
was chunked. With `cpu_features.batch_variant` it attends to decode sequences, short extends and
short prompts (`kernel_attends`); longer prefills/extends in the same batch go to the reference's
SDPA, one call per sequence, because SDPA's GEMMs beat the kernel's dot products there, except in
bfloat16 where the library has AMX: there the kernel's tile products take every length. fp8
caches go to the reference (the kernel reads float32, bfloat16 and float16 caches).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels import cpu_features, reference, validation
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
    "greedy_pick",
    "library_path",
    "loaded",
    "moe_route",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# The sources by translation unit: cpu_gguf.cpp alone (20 s of g++ on the 2-core dev VM), the
# other three as one (17 s, against 27 s apart: each spent about 7 s in torch's headers), so that
# two cores build a library in the time of the longest unit.
UNITS = (
    (_CSRC / "cpu_gguf.cpp",),
    tuple(_CSRC / name for name in ("cpu_attention.cpp", "cpu_layer_ops.cpp", "cpu_decoder.cpp")),
)
SOURCES = tuple(source for unit in UNITS for source in unit)
HEADERS = (_CSRC / "cpu_math.h", _CSRC / "cpu_kernels.h")
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
# What falls back to the torch reference when no library loads (the one warning names them).
COMPILED_OPS = (
    "paged attention, RMSNorm, residual add + RMSNorm, SiLU-and-multiply and rotary + KV write"
)
# Which sequences the kernel attends to (`kernel_attends`), the others going to the reference's SDPA
# one call each: decodes and extends of up to KERNEL_MAX_NEW_TOKENS always (1.6-4x faster than SDPA,
# still even at 4 new tokens over a 1k context), and longer ones while the pairs of (new token, key
# it sees) stay within KERNEL_MAX_PAIRS for the dtype: a 128-token prompt takes 0.8x SDPA's time in
# bf16 and 0.5x in float32; SDPA's GEMMs win from about 256 new tokens in bf16 and 512 in float32
# (measured on the 2-core dev VMs: docs/benchmarks-history.md, "CPU attention kernel" and "The
# decode step as one call").
KERNEL_MAX_NEW_TOKENS = 4
KERNEL_MAX_PAIRS = {torch.float32: 65536, torch.bfloat16: 16384, torch.float16: 16384}
# Where the library has AMX (`amx_tiles`), bfloat16 sequences of these head_dims go through the
# kernel's tile products whatever their length: about 2x faster than SDPA one call per sequence,
# from 16 prompts of 128 tokens to one of 2048 (docs/benchmarks-history.md, "Prefill attention on
# AMX tiles").
AMX_HEAD_DIMS = (64, 128)
# Every build's flags but the instruction set (`cpu_features.kernel_flags` / `march_flags`). No
# -ffast-math: the kernel's -inf handling needs IEEE infinities. 512-bit vectors where the level has
# them (GCC's loops otherwise stay at 256 bits on AVX-512 CPUs): the bf16 layer ops of a 2048-token
# prefill took 0.68x the time (docs/benchmarks-history.md, "The decode step as one call").
CXX_FLAGS = (
    "-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-fPIC", "-w",
    "-mprefer-vector-width=512",
)  # fmt: skip


@dataclass(frozen=True)
class KernelLibrary:
    """A library of the kernels: its file, the level its instructions are for, where it came from
    ("prebuilt", "cached" or "compiled") and its instruction-set flags."""

    path: Path
    level: str
    origin: str
    march: tuple[str, ...]


def _kernel_dir() -> Path:
    root = cache_dir()
    return (root if root is not None else Path(tempfile.mkdtemp(prefix="pagedserve-"))) / "kernels"


def _compiler() -> str | None:
    """The C++ compiler: $CXX when set, else c++ / g++ / clang++ on PATH; None when absent."""
    configured = os.environ.get("CXX")
    candidates = [configured] if configured else ["c++", "g++", "clang++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _file_name(level: str, march: tuple[str, ...]) -> str:
    """pagedserve_cpu_<level>_<hash>.so: the hash of what the library is built from (raises
    FileNotFoundError for a missing source or header). -march=native builds for this very CPU,
    so its flags go in the hash too."""
    key = hashlib.sha256()
    native = march == cpu_features.NATIVE_MARCH
    cpu = " ".join(sorted(cpu_features.cpu_features().flags)) if native else ""
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(CXX_FLAGS + march).encode(),
                 torch.__version__.encode(), cpu.encode()):  # fmt: skip
        key.update(part)
        key.update(b"\0")
    return f"pagedserve_cpu_{level}_{key.hexdigest()[:16]}.so"


def library_path() -> Path:
    """Where this machine's build of the kernels for the chosen level lives (built or not)."""
    features = cpu_features.cpu_features()
    return _kernel_dir() / _file_name(features.level, cpu_features.kernel_flags(features))


def prebuilt_path(level: str, folder: Path | None = None) -> Path:
    """The prebuilt library of an x86 level in `folder` (PREBUILT_DIR), built or not."""
    march = cpu_features.march_flags(level)
    return (folder or PREBUILT_DIR) / _file_name(level, march)


def _prebuilt_candidates() -> list[KernelLibrary]:
    """The prebuilt libraries there are for the chosen level and those below it, highest first."""
    features = cpu_features.cpu_features()
    levels = [lvl for lvl in cpu_features.PREBUILT_LEVELS if features.at_least(lvl)]
    found = []
    for level in reversed(levels):
        path = prebuilt_path(level)
        if path.is_file():
            found.append(KernelLibrary(path, level, "prebuilt", cpu_features.march_flags(level)))
    return found


def _run(cmd: list[str]) -> str | None:
    """Run one compiler command: None, or its error when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"{cmd[0]} failed ({done.returncode}): {done.stderr}"


def _build(targets: list[tuple[Path, tuple[str, ...]]], compiler: str) -> None:
    """Compile UNITS into each target with its instruction-set flags. The units of all targets
    compile in parallel (one process per core), then each links into a temporary file that is
    renamed, so concurrent builders (server processes, test workers) never load a half-written
    library."""
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    start = time.perf_counter()
    logger.warning(
        "compiling pagedserve's CPU kernels (%s; once, into %s)",
        "; ".join(" ".join(march) for _, march in targets),
        ", ".join(sorted({str(target.parent) for target, _ in targets})),
    )
    with tempfile.TemporaryDirectory(prefix="pagedserve-build-") as tmp:
        objects: list[list[str]] = []
        commands = []
        for i, (_, march) in enumerate(targets):
            objects.append([])
            for j, unit in enumerate(UNITS):
                source = unit[0]
                if len(unit) > 1:  # one file that includes the unit's sources
                    source = Path(tmp) / f"unit-{j}.cpp"
                    source.write_text("".join(f'#include "{s}"\n' for s in unit))
                obj = str(Path(tmp) / f"{i}-{j}.o")
                objects[-1].append(obj)
                commands.append([compiler, *CXX_FLAGS, *march, abi, *includes, "-c", str(source),
                                 "-o", obj])  # fmt: skip
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            errors = [e for e in pool.map(_run, commands) if e]
        if errors:
            raise RuntimeError(errors[0][-2000:])
        for (target, march), objs in zip(targets, objects, strict=True):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            try:
                error = _run([compiler, *CXX_FLAGS, *march, "-shared", *objs, "-o", partial,
                              f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"])  # fmt: skip
                if error:
                    raise RuntimeError(error[-2000:])
                os.replace(partial, target)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
    logger.warning("CPU kernels compiled in %.1f s", time.perf_counter() - start)


def _fall_back(why: str) -> None:
    logger.warning(
        "%s fall back to the slower torch reference, and GGUF weights are dequantized at load: %s",
        COMPILED_OPS,
        why,
    )


@functools.cache
def loaded() -> KernelLibrary | None:
    """The library of the kernels this process loaded (finding or building it on the first call:
    see the module's docstring), or None, after one warning saying why, where none loads."""
    try:
        features = cpu_features.cpu_features()
        march = cpu_features.kernel_flags(features)
        candidates = _prebuilt_candidates()
        cached = library_path()
    except OSError as exc:  # a source or header missing from the package
        _fall_back(f"the kernels' sources are incomplete ({exc})")
        return None
    if cached.is_file():
        candidates.append(KernelLibrary(cached, features.level, "cached", march))
    if not candidates:
        compiler = _compiler()
        if compiler is None:
            _fall_back(
                "no C++ compiler found (set CXX, or install g++) and no prebuilt or cached "
                "library of the kernels"
            )
            return None
        try:
            _build([(cached, march)], compiler)
        except (OSError, RuntimeError, ImportError) as exc:  # ImportError: torch's setuptools
            _fall_back(f"the build failed: {exc}")
            return None
        candidates.append(KernelLibrary(cached, features.level, "compiled", march))
    problems = []
    for library in candidates:
        try:
            torch.ops.load_library(str(library.path))
        except (OSError, RuntimeError) as exc:  # a damaged file, or one built for another torch
            problems.append(f"{library.path} not loaded (delete it to rebuild): {exc}")
            continue
        if problems:
            logger.warning(
                "skipped the kernel libraries that did not load: %s", "; ".join(problems)
            )
        logger.info(
            "pagedserve's CPU kernels: the %s library for level %s (%s), %s",
            library.origin, library.level, " ".join(library.march), library.path,
        )  # fmt: skip
        return library
    _fall_back("; ".join(problems))
    return None


def available() -> bool:
    """Whether the compiled kernels are loaded (`loaded()`: found or built on the first call).
    False, with one warning saying why, where none can be."""
    return loaded() is not None


@functools.cache
def amx_tiles() -> bool:
    """Whether the loaded library has AMX's bf16 tiles and Linux granted them to the process: a
    native build on a CPU with AMX-BF16 (the attention kernel's prefill tiles and the kept GGUF
    weights' matmuls use them)."""
    return available() and bool(torch.ops.pagedserve_cpu.amx_available())


def kernel_attends(q_len: int, seq_len: int, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel attends to a sequence of `q_len` new tokens, `seq_len` in all, rather
    than the reference's SDPA: every one by default (one arithmetic per query, however its
    tokens are chunked), else as KERNEL_MAX_PAIRS and AMX_HEAD_DIMS say
    (`cpu_features.batch_variant`)."""
    if q_len <= KERNEL_MAX_NEW_TOKENS or not cpu_features.batch_variant():
        return True
    if dtype == torch.bfloat16 and head_dim in AMX_HEAD_DIMS and amx_tiles():
        return True
    pairs = q_len * (seq_len - (q_len - 1) / 2)  # new token i sees seq_len - q_len + i + 1 keys
    return pairs <= KERNEL_MAX_PAIRS.get(dtype, 0)


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
    take = [
        kernel_attends(n, total, q.dtype, q.shape[-1])
        for n, total in zip(q_lens, seq_lens_h, strict=True)
    ]
    if any(take):
        torch.ops.pagedserve_cpu.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale),
            sliding_window or 0, softcap or 0.0, None if all(take) else torch.tensor(take),
            cpu_features.batch_variant(), out,
        )  # fmt: skip
    for i, n in enumerate(q_lens):
        if not take[i]:
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


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 CPU logits [rows, vocab] (rows contiguous): each row's first index of its
    largest value (int64), and whether the row is all finite (bool; a row that is not gets id 0),
    in one call (the sampler's greedy rows: engine/worker/sampler.py, which checks `available()`
    first and otherwise takes torch's ops)."""
    if not available():
        raise RuntimeError("greedy_pick needs pagedserve's compiled CPU kernels (not loaded)")
    n = logits.shape[0]
    ids = torch.empty(n, dtype=torch.long)
    finite = torch.empty(n, dtype=torch.bool)
    torch.ops.pagedserve_cpu.greedy_pick(_rows(logits), ids, finite)
    return ids, finite


def temperature_pick(
    logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 CPU logits [rows, vocab] (rows contiguous), rows that sample by temperature
    alone: row i's token drawn from softmax(logits[i] / temperatures[i]) by its uniform, as the
    sampler's `inverse_cdf_sample` draws (int64), and whether the row is all finite (bool; a row
    that is not gets id 0), in one call (engine/worker/sampler.py checks `available()` first)."""
    if not available():
        raise RuntimeError("temperature_pick needs pagedserve's compiled CPU kernels (not loaded)")
    n = logits.shape[0]
    ids = torch.empty(n, dtype=torch.long)
    finite = torch.empty(n, dtype=torch.bool)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    torch.ops.pagedserve_cpu.temperature_pick(
        _rows(logits), temps, uniforms.double().contiguous(), ids, finite
    )
    return ids, finite


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


def build_prebuilt(levels: tuple[str, ...], folder: Path | None = None) -> list[Path]:
    """Compile the portable library of each x86 level into `folder` (PREBUILT_DIR), replacing
    that level's older builds there; the libraries' paths. Any x86 host compiles every level (it
    needs not run them)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    folder = folder or PREBUILT_DIR
    targets = [(prebuilt_path(level, folder), cpu_features.march_flags(level)) for level in levels]
    _build(targets, compiler)
    kept = {target for target, _ in targets}
    for level in levels:
        for old in folder.glob(f"pagedserve_cpu_{level}_*.so"):
            if old not in kept:
                old.unlink()
    return [target for target, _ in targets]


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.kernels.cpu_ops`: build (or find) this machine's library ahead of
    time (`make install`); with --prebuilt, the portable library of every x86 level into
    PREBUILT_DIR (Docker images), then check that this machine's level's loads."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--prebuilt", action="store_true", help="build every level's library")
    parser.add_argument(
        "--levels", nargs="+", choices=cpu_features.PREBUILT_LEVELS,
        default=cpu_features.PREBUILT_LEVELS, help="the levels --prebuilt builds (default: all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.prebuilt:
        return 0 if available() else 1
    features = cpu_features.cpu_features()
    if not features.x86:
        logger.error("prebuilt libraries are for x86-64 CPUs; build this one's without --prebuilt")
        return 1
    try:
        build_prebuilt(tuple(args.levels))
    except (OSError, RuntimeError, ImportError) as exc:
        logger.error("prebuilt libraries not built: %s", exc)
        return 1
    library = loaded()
    if library is None or library.origin != "prebuilt" or library.level != features.level:
        logger.error(
            "built, but this machine's level (%s) has no prebuilt library that loads: %s",
            features.level, library,
        )  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
