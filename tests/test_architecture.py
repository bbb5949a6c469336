"""The package rules of ARCHITECTURE.md, checked: imports only point down the table."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after_import(package: str) -> set[str]:
    code = f"import sys, {package}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_scheduler_is_pure_python():
    loaded = _modules_after_import("scheduler")
    assert "torch" not in loaded and "numpy" not in loaded
    assert not loaded & {"engine", "kernels", "server"}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("kernels", {"engine", "server", "scheduler"}),
        ("engine", {"server", "bench"}),
    ],
)
def test_imports_point_down(package, forbidden):
    assert not _modules_after_import(package) & forbidden
