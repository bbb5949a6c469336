"""The import rules of ARCHITECTURE.md, checked on the source: every import statement, those inside
functions included, so that a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "kernels", "engine", "server", "bench", "tests")
# The one import name of an installed pagedserve: the folders above are its subpackages.
NAMESPACE = "pagedserve"

# ARCHITECTURE.md's table: the project packages each package may import.
ALLOWED = {
    "scheduler": set(),
    "kernels": set(),
    "engine": {"scheduler", "kernels"},
    "server": {"scheduler", "engine"},
    "bench": {"scheduler", "kernels", "engine", "server"},
    "tests": {"scheduler", "kernels", "engine", "server"},
}
# The one lazy import of bench outside bench/: the `pagedserve bench` command.
LAZY_BENCH_IMPORTERS = {"server/cli.py"}
# The tests' conftest takes bench's `checkout_root_last` (sys.path for runs from a checkout).
BENCH_IMPORTERS_IN_TESTS = {"tests/conftest.py"}


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    module: str  # the imported module, absolute
    lazy: bool  # inside a function
    names: tuple[str, ...] = ()  # what `from module import ...` takes

    @property
    def project(self) -> str:
        """The module without the installed namespace: `pagedserve.engine.x` -> `engine.x`."""
        return self.module.removeprefix(f"{NAMESPACE}.")

    @property
    def top(self) -> str:
        return self.project.split(".")[0]

    @property
    def modules(self) -> set[str]:
        """The module and, for `from package import name`, package.name (a submodule or not)."""
        return {self.project, *(f"{self.project}.{name}" for name in self.names)}


def _imports(path: Path) -> list[Import]:
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), rel)
    found = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend(Import(rel, child.lineno, a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{rel}:{child.lineno}: relative import"
                names = tuple(a.name for a in child.names)
                if child.module == NAMESPACE:  # `from pagedserve import kernels`: each a package
                    found.extend(Import(rel, child.lineno, f"{NAMESPACE}.{n}", lazy) for n in names)
                else:
                    found.append(Import(rel, child.lineno, child.module or "", lazy, names))
            visit(child, inner)

    visit(tree, False)
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


ALL_IMPORTS = {p: [i for f in _sources(p) for i in _imports(f)] for p in PACKAGES}


def test_the_scan_sees_every_package_and_lazy_imports():
    # Guards the test itself: known imports, one lazy, must be found.
    cli = [i for i in ALL_IMPORTS["server"] if i.path == "server/cli.py"]
    assert any(i.project == "bench.cli" and i.lazy for i in cli)
    assert any(i.project == "engine.engine_config" and not i.lazy for i in cli)
    assert all(ALL_IMPORTS[p] for p in PACKAGES)


def test_the_project_is_imported_through_its_namespace():
    # An installed pagedserve has no top-level `kernels` or `server` (names other distributions
    # use: Hugging Face's `kernels` among them), so the code never imports them bare.
    bare = [
        f"{i.path}:{i.line} imports {i.module}"
        for p in PACKAGES
        for i in ALL_IMPORTS[p]
        if i.module.split(".")[0] in PACKAGES[:-1]
    ]
    assert bare == []


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_table(package):
    bad = []
    for imp in ALL_IMPORTS[package]:
        if imp.top not in PACKAGES or imp.top == package:
            continue
        allowed = imp.top in ALLOWED[package]
        if imp.top == "bench":
            allowed = (
                (imp.lazy and imp.path in LAZY_BENCH_IMPORTERS)
                or imp.path.startswith("tests/bench/")
                or imp.path in BENCH_IMPORTERS_IN_TESTS
            )
        if not allowed:
            bad.append(f"{imp.path}:{imp.line} imports {imp.module}")
    assert bad == []


def test_scheduler_is_pure_python():
    third_party = [
        f"{i.path}:{i.line} imports {i.module}"
        for i in ALL_IMPORTS["scheduler"]
        if i.top not in sys.stdlib_module_names and i.top not in ("__future__", "scheduler")
    ]
    assert third_party == []


TRITON_MODULES = {
    "kernels/triton_attention.py",
    "kernels/triton_fused.py",
    "kernels/triton_moe.py",
    "kernels/triton_ops.py",
}


def test_triton_is_imported_only_by_the_triton_modules():
    # CPU runs never import Triton: only the Triton modules import it, and outside them only the
    # backend switch imports them, lazily, when the triton backend is asked for.
    product = [i for p in ("scheduler", "kernels", "engine", "server") for i in ALL_IMPORTS[p]]
    assert {i.path for i in product if i.top == "triton"} == TRITON_MODULES - {
        "kernels/triton_ops.py"
    }
    outside = [
        (i.path, i.lazy)
        for i in product
        if i.path not in TRITON_MODULES and any(m.startswith("kernels.triton_") for m in i.modules)
    ]
    assert outside == [("kernels/__init__.py", True)]


def test_bench_extra_modules_stay_in_bench():
    # httpx and matplotlib come with the `bench` extra; the server must run without them.
    outside = [
        f"{i.path}:{i.line} imports {i.module}"
        for p in ("scheduler", "kernels", "engine", "server")
        for i in ALL_IMPORTS[p]
        if i.top in ("httpx", "matplotlib")
    ]
    assert outside == []


def test_only_entry_points_tune_the_allocator():
    # keep_large_allocations_in_heap changes the whole process: the `pagedserve` entry point, the
    # test session and the CPU benchmarks decide it, never a library object such as LLMEngine.
    callers = {
        i.path
        for p in PACKAGES
        for i in ALL_IMPORTS[p]
        if "keep_large_allocations_in_heap" in i.names
    }
    assert callers == {
        "server/cli.py",
        "engine/frontend/core_process.py",  # the entry point of the engine core's own process
        "engine/worker/tp_worker.py",  # the entry point of a tensor-parallel rank's process
        "tests/conftest.py",
        "bench/compare_serve.py",
        "bench/compare_transformers.py",
        "bench/host_step.py",
    }
