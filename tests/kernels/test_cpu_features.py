"""The CPU decisions (kernels/cpu_features.py): levels read from /proc/cpuinfo texts of real CPUs,
the PAGEDSERVE_CPU_ISA override (a lesser level only), and what each level decides: native bf16,
oneDNN's bf16 packing, the matmuls by GGUF blocks, the kernels' compiler flags and the variables
that make torch and oneDNN act as that CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import cpu_features
from pagedserve.kernels.cpu_features import ISA_ENV, CPUFeatures, features_from

# The flags lines of real CPUs' /proc/cpuinfo (trimmed of flags that decide nothing here).
V3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma bmi1 bmi2 f16c abm movbe xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
CPUINFO = {
    # AMD EPYC 7B12 (Zen 2): AVX2 only.
    "epyc_avx2": f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {V3} sha_ni clzero\n",
    # Intel Xeon (Cascade Lake): AVX-512 with VNNI, no bf16.
    "xeon_avx512": f"processor\t: 0\nflags\t\t: {V4} avx512_vnni\nbugs\t\t: spectre_v1\n",
    # AMD EPYC (Zen 4): AVX-512 with bf16 dot products.
    "epyc_avx512_bf16": f"processor\t: 0\nflags\t\t: {V4} avx512_vnni avx512_bf16\n",
    # Intel Xeon (Sapphire Rapids): AMX tiles.
    "xeon_amx": f"processor\t: 0\nflags\t\t: {V4} avx512_fp16 amx_bf16 amx_tile amx_int8\n",
    # An AVX2-class CPU with avx_ne_convert (Intel Sierra Forest): oneDNN packs bf16 there.
    "xeon_avx2_ne_convert": f"processor\t: 0\nflags\t\t: {V3} avx_vnni avx_ne_convert\n",
    # AVX2 and FMA, but a VM that hides movbe: x86-64-v3 code may not run.
    "vm_no_movbe": f"flags\t\t: {V3.replace(' movbe', '')}\n",
    "old_x86": "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx\n",
    # AWS Graviton 3.
    "arm": "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n",
}
MACHINE = {"arm": "aarch64"}


def features(name: str, override: str | None = None) -> CPUFeatures:
    return features_from(CPUINFO[name], MACHINE.get(name, "x86_64"), override)


@pytest.mark.parametrize(
    "name, level",
    [
        ("epyc_avx2", "avx2"),
        ("xeon_avx512", "avx512"),
        ("epyc_avx512_bf16", "avx512_bf16"),
        ("xeon_amx", "avx512_bf16"),
        ("xeon_avx2_ne_convert", "avx2"),
        ("vm_no_movbe", "baseline"),
        ("old_x86", "baseline"),
        ("arm", "native"),
    ],
)
def test_the_level_of_each_cpu(name, level):
    f = features(name)
    assert (f.detected, f.level, f.forced) == (level, level, False)
    assert f.x86 is (name != "arm")
    assert features_from("", "x86_64").level == "baseline"  # no /proc/cpuinfo: assume little


@pytest.mark.parametrize(
    "name, native_bf16, onednn_bf16, block_dot",
    [
        ("epyc_avx2", False, False, True),
        ("xeon_avx512", False, True, True),
        ("epyc_avx512_bf16", True, True, True),
        ("xeon_amx", True, True, True),
        ("xeon_avx2_ne_convert", False, True, True),
        ("old_x86", False, False, False),
        ("arm", False, True, False),  # off x86, torch's own check decides
    ],
)
def test_what_each_cpu_decides_at_its_own_level(name, native_bf16, onednn_bf16, block_dot):
    f = features(name)
    assert cpu_features.bf16_is_native(f) is native_bf16
    assert cpu_features.onednn_bf16_level(f) is onednn_bf16
    assert cpu_features.block_dot_allowed(f) is block_dot
    assert cpu_features.kernel_flags(f) == ("-march=native",)  # own level: tuned for this CPU


def test_a_lesser_level_is_decided_by_and_compiled_for():
    amx = features("xeon_amx", "avx2")
    assert (amx.detected, amx.level, amx.forced) == ("avx512_bf16", "avx2", True)
    assert not cpu_features.bf16_is_native(amx)
    assert not cpu_features.onednn_bf16_level(amx)
    assert cpu_features.block_dot_allowed(amx)  # AVX2 has them
    assert not cpu_features.block_dot_allowed(features("xeon_amx", "baseline"))
    assert cpu_features.kernel_flags(amx) == ("-march=x86-64-v3",)
    # avx_ne_convert belongs to the CPU's own level: a forced avx2 does not keep it.
    assert cpu_features.onednn_bf16_level(features("xeon_avx2_ne_convert", "avx2"))  # own level
    assert not cpu_features.onednn_bf16_level(features("xeon_avx2_ne_convert", "baseline"))
    avx512 = features("epyc_avx512_bf16", "avx512")
    assert cpu_features.onednn_bf16_level(avx512) and not cpu_features.bf16_is_native(avx512)
    assert cpu_features.kernel_flags(avx512) == ("-march=x86-64-v4",)
    assert cpu_features.kernel_flags(features("xeon_amx", "baseline")) == ("-march=x86-64-v2",)
    same = features("epyc_avx2", "avx2")  # the CPU's own level, named: nothing forced
    assert not same.forced and cpu_features.kernel_flags(same) == ("-march=native",)


def test_the_flags_and_variables_of_each_level():
    assert [cpu_features.march_flags(level) for level in cpu_features.X86_LEVELS] == [
        ("-march=x86-64-v2",),
        ("-march=x86-64-v3",),
        ("-march=x86-64-v4",),
        ("-march=x86-64-v4", "-mavx512bf16"),
    ]
    assert [cpu_features.emulation_env(level) for level in cpu_features.X86_LEVELS] == [
        {"ONEDNN_MAX_CPU_ISA": "SSE41", "ATEN_CPU_CAPABILITY": "default"},
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
    ]
    with pytest.raises(ValueError, match="no portable flags for level 'native'"):
        cpu_features.march_flags("native")


def test_a_level_above_the_cpus_or_unknown_is_refused():
    with pytest.raises(ValueError) as info:
        features("epyc_avx2", "avx512_bf16")
    assert str(info.value) == (
        "PAGEDSERVE_CPU_ISA='avx512_bf16' is above this CPU's level 'avx2': choose one of "
        "baseline, avx2"
    )
    with pytest.raises(ValueError) as info:
        features("xeon_amx", "avx3")
    assert str(info.value) == (
        "PAGEDSERVE_CPU_ISA='avx3' is not a CPU level (this CPU's is 'avx512_bf16'): choose one of "
        "baseline, avx2, avx512, avx512_bf16"
    )
    with pytest.raises(ValueError, match="'avx2' is above this CPU's level 'native': choose "):
        features("arm", "avx2")


def test_this_machine(monkeypatch):
    # The process's features are read once; a bad override raises at every decision.
    monkeypatch.setenv(ISA_ENV, "no-such-level")
    cpu_features.cpu_features.cache_clear()
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="is not a CPU level"):
                cpu_features.bf16_is_native()
    finally:
        monkeypatch.undo()  # the process's own environment again (with its override, if any)
        cpu_features.cpu_features.cache_clear()
    assert cpu_features.onednn_bf16() == (
        cpu_features.onednn_bf16_level() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def test_the_override_makes_torch_and_onednn_act_as_the_lesser_cpu():
    """Set before torch computes (importing pagedserve's kernels sets them), the variables lower
    ATen's kernels and oneDNN's ISA: bf16 packing is refused there, as on an AVX2 CPU."""
    if not cpu_features.cpu_features().at_least("avx512"):
        pytest.skip(
            f"lowers to avx2, so it needs a CPU of level avx512 or above; this process's level "
            f"is {cpu_features.cpu_features().level}, where the suite runs the avx2 paths natively"
        )
    code = (
        "import os, torch, pagedserve.engine\n"
        "print(os.environ['ONEDNN_MAX_CPU_ISA'], os.environ['ATEN_CPU_CAPABILITY'])\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
        "print(torch.ops.mkldnn._is_mkldnn_bf16_supported())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_features.emulation_env("avx2")}
    env[ISA_ENV] = "avx2"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.split() == ["AVX2", "avx2", "AVX2", "False"]
