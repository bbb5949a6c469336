"""Every decision pagedserve takes from the CPU it runs on, in one place.

The CPU's features are read once (/proc/cpuinfo's flags) and named by an ISA level:

    avx512_bf16  avx512 below, and bf16 dot products (avx512_bf16) or AMX tiles (amx_bf16)
    avx512       x86-64-v4: x86-64-v3 and avx512f, avx512bw, avx512cd, avx512dq, avx512vl
    avx2         x86-64-v3: avx, avx2, fma, bmi1, bmi2, f16c, abm (lzcnt), movbe, xsave
    baseline     any other x86-64 CPU
    native       a CPU of another architecture (or no /proc/cpuinfo): no level of its own; the
                 kernels are compiled for it, everything else asks torch

The levels name the psABI's x86-64-v3 / v4 sets whole, not just avx2 + fma or the four avx512
flags, because a level's portable kernel library is compiled with -march=x86-64-v3 / v4, which
may use any instruction of the set (a VM that hides movbe gets the level below, never SIGILL).

The decisions derived from the level, each a function here and called by every place that takes
it: `bf16_is_native` (the CPU's default dtype), `onednn_bf16` (whether oneDNN's bf16 weight
packing may run), `block_dot_allowed` (pagedserve's matmuls by a GGUF file's quantized blocks),
`kernel_flags` / `march_flags` (the C++ kernels' compiler flags).

PAGEDSERVE_CPU_ISA=<level> makes pagedserve take the decisions of that level on a CPU that has
more (a level above the CPU's, or an unknown name, is a ValueError at the first decision): tests
reach an AVX2 machine's paths on an AVX512 one this way. With it set, importing this module also
sets ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY (`emulation_env`; os.environ.setdefault, so what
the caller set wins), and torch's own kernels and oneDNN then emulate the lesser CPU too, as long
as the import comes before torch first computes: ATen fixes its CPU capability at its first op,
oneDNN at its first primitive. `pagedserve.kernels` imports this module first thing, so
`import pagedserve.<anything>` before any torch work is enough; a process that computed with
torch earlier should set the two variables itself.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ISA_ENV = "PAGEDSERVE_CPU_ISA"
# Opt-in to the kernels' faster paths whose results depend on the batch (`batch_variant`): the
# CPU kernels' and the Triton attention's.
BATCH_VARIANT_ENV = "PAGEDSERVE_BATCH_VARIANT"
# x86 levels, lowest first.
X86_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16")
NATIVE = "native"
# Levels a portable library is built for (`python -m pagedserve.kernels.cpu_ops --prebuilt`):
# baseline CPUs are rare enough to compile for themselves.
PREBUILT_LEVELS = ("avx2", "avx512", "avx512_bf16")

# /proc/cpuinfo flag names (lzcnt is "abm" there).
_V3_FLAGS = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe", "xsave"})
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# torch's check before oneDNN's bf16 reorder (`mkldnn_bf16_device_check`) wants avx_ne_convert,
# or avx512bw, avx512vl and avx512dq (which level avx512 has); elsewhere `_reorder_linear_weight`
# raises on bf16.
_ONEDNN_BF16_NE_CONVERT = "avx_ne_convert"

_MARCH = {
    "baseline": ("-march=x86-64-v2",),
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
}
NATIVE_MARCH = ("-march=native",)
# The variables that make oneDNN (its maximum ISA) and ATen (its kernels' capability) act as a
# CPU of each level would.
_ONEDNN_ISA = {
    "baseline": "SSE41",
    "avx2": "AVX2",
    "avx512": "AVX512_CORE",
    "avx512_bf16": "AVX512_CORE_BF16",
}
_ATEN_CAPABILITY = {
    "baseline": "default",
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512_bf16": "avx512",
}


@dataclass(frozen=True)
class CPUFeatures:
    """The CPU's flags, its own level (`detected`) and the level pagedserve decides by (`level`:
    the detected one, or a lesser one PAGEDSERVE_CPU_ISA asked for)."""

    flags: frozenset[str]
    x86: bool
    detected: str
    level: str

    @property
    def forced(self) -> bool:
        """Whether the decisions are a lesser level's, not this CPU's own."""
        return self.level != self.detected

    def at_least(self, level: str) -> bool:
        """Whether the chosen level is `level` or above (an x86 level; False off x86)."""
        return self.x86 and X86_LEVELS.index(self.level) >= X86_LEVELS.index(level)


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo's text (x86's `flags` lines; ARM's lines are
    `Features`)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def detect_level(flags: frozenset[str], x86: bool) -> str:
    """The level of a CPU with these flags (see the module's docstring)."""
    if not x86:
        return NATIVE
    if _V4_FLAGS <= flags:
        return "avx512_bf16" if any(f in flags for f in _BF16_FLAGS) else "avx512"
    return "avx2" if _V3_FLAGS <= flags else "baseline"


def choices(detected: str) -> tuple[str, ...]:
    """The levels PAGEDSERVE_CPU_ISA may name on a CPU of level `detected`: it and those below."""
    if detected == NATIVE:
        return (NATIVE,)
    return X86_LEVELS[: X86_LEVELS.index(detected) + 1]


def features_from(cpuinfo: str, machine: str, override: str | None = None) -> CPUFeatures:
    """The features of a CPU given its /proc/cpuinfo text and `platform.machine()`, deciding by
    `override` (a level name; None or '' for the CPU's own). ValueError for a level above the
    CPU's or an unknown name, naming the detected level and the valid choices."""
    x86 = machine.lower() in ("x86_64", "amd64", "x86-64")
    flags = parse_flags(cpuinfo)
    detected = detect_level(flags, x86)
    level = detected
    if override:
        valid = choices(detected)
        if override not in valid:
            if override in X86_LEVELS or override == NATIVE:
                what = f"is above this CPU's level {detected!r}"
            else:
                what = f"is not a CPU level (this CPU's is {detected!r})"
            raise ValueError(f"{ISA_ENV}={override!r} {what}: choose one of {', '.join(valid)}")
        level = override
    return CPUFeatures(flags, x86, detected, level)


@functools.cache
def cpu_features() -> CPUFeatures:
    """This process's CPU, read once: /proc/cpuinfo (unreadable: no flags, so x86 CPUs are
    `baseline`) and PAGEDSERVE_CPU_ISA. A bad PAGEDSERVE_CPU_ISA raises its ValueError here, at
    every call (nothing is cached for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return features_from(cpuinfo, platform.machine(), os.environ.get(ISA_ENV))


# ---- the decisions -------------------------------------------------------------------------------


def bf16_is_native(features: CPUFeatures | None = None) -> bool:
    """Whether the CPU computes bf16 in hardware (level avx512_bf16: dot products or AMX tiles):
    there bf16 is faster than float32 (docs/benchmarks-history.md) and the default dtype; elsewhere
    oneDNN emulates it and float32 is the better default."""
    features = features or cpu_features()
    return features.at_least("avx512_bf16")


def onednn_bf16_level(features: CPUFeatures | None = None) -> bool:
    """Whether the level lets oneDNN's bf16 packing run: the CPU passes torch's check
    (avx512bw+vl+dq, or avx_ne_convert) and the chosen level has it (avx512 and above, or the
    CPU's own level for avx_ne_convert, which AVX2-class CPUs have). Off x86, torch decides."""
    features = features or cpu_features()
    if not features.x86:
        return True
    if features.at_least("avx512"):  # the level's flags include avx512bw, vl and dq
        return True
    return not features.forced and _ONEDNN_BF16_NE_CONVERT in features.flags


def onednn_bf16() -> bool:
    """Whether bf16 weights may be packed for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`,
    `_linear_pointwise`): the level allows it (`onednn_bf16_level`) and torch's oneDNN agrees
    (`_is_mkldnn_bf16_supported` follows oneDNN's effective ISA, so ONEDNN_MAX_CPU_ISA lowers it).
    Nothing may call the reorder on bf16 where this is False: it raises there."""
    if not onednn_bf16_level():
        return False
    import torch

    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def block_dot_allowed(features: CPUFeatures | None = None) -> bool:
    """Whether pagedserve's matmuls by GGUF blocks (kernels/csrc/cpu_gguf.cpp) may run: level
    avx2 and above, whose libraries are compiled with AVX2, FMA and F16C (x86-64-v3); VNNI is
    the compiler's to use where -march allows it. Whether the loaded library has them is
    `torch.ops.pagedserve_cpu.block_dot_isa()` (empty without)."""
    features = features or cpu_features()
    return features.at_least("avx2")


@functools.cache
def batch_variant() -> bool:
    """Whether the CPU kernels may take their faster paths whose results depend on what else
    shares a step: PAGEDSERVE_BATCH_VARIANT=1, off by default.

    By default a row's arithmetic is a function of its own inputs and position alone: the kept GGUF
    weights multiply every step by the blocks' integer dot products (no dense or AMX route for long
    steps), the attention kernel takes every sequence (no SDPA for long prompts) with one reduction
    order per query (no split of one stream's keys across threads, no AMX tiles), so temperature 0
    is a function of the prompt, whether it is batched, cached, chunked or streamed
    (docs/benchmarks-history.md, "One request, one answer", says what the faster paths gain). The
    Triton attention reads it too (`triton_attention.paged_attention`): by default one kernel in one
    configuration for every step; with it, the split-context decode kernel for decode steps,
    its splits from the batch and the SM count."""
    value = os.environ.get(BATCH_VARIANT_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"{BATCH_VARIANT_ENV} must be 1 or 0, got {value!r}")
    return value in ("1", "true", "yes")


def march_flags(level: str) -> tuple[str, ...]:
    """The portable compiler flags of an x86 level's kernel library (-march=x86-64-v3 ...)."""
    if level not in _MARCH:
        raise ValueError(f"no portable flags for level {level!r}; levels: {', '.join(_MARCH)}")
    return _MARCH[level]


def kernel_flags(features: CPUFeatures | None = None) -> tuple[str, ...]:
    """The compiler flags that pick the instructions of the C++ kernels at the chosen level:
    -march=native at the CPU's own level (fastest: tuned for this very CPU), the level's portable
    flags for a lesser one."""
    features = features or cpu_features()
    return march_flags(features.level) if features.forced else NATIVE_MARCH


def emulation_env(level: str) -> dict[str, str]:
    """ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY for an x86 level: torch and oneDNN then act as
    on a CPU of that level."""
    if level not in _ONEDNN_ISA:
        raise ValueError(f"no emulation for level {level!r}; levels: {', '.join(_ONEDNN_ISA)}")
    return {
        "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[level],
        "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[level],
    }


def _set_emulation_env() -> None:
    """With a lesser level forced, `emulation_env`'s variables where the environment has none
    yet. A bad PAGEDSERVE_CPU_ISA sets nothing: its ValueError comes at the first decision, not at
    an import."""
    if not os.environ.get(ISA_ENV):
        return
    try:
        features = cpu_features()
    except ValueError:
        return
    if features.forced:
        for key, value in emulation_env(features.level).items():
            os.environ.setdefault(key, value)


_set_emulation_env()
