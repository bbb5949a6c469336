"""The import rules of ARCHITECTURE.md, checked on the source: every import statement, those inside
functions included, so that a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The product's folders, then the checkout's own: the lab's benchmarks and the tests.
PRODUCT = ("scheduler", "kernels", "engine", "server", "bench")
PACKAGES = (*PRODUCT, "benchmarks", "tests")
# The one import name of an installed pagedserve: the product's folders are its subpackages.
NAMESPACE = "pagedserve"

# ARCHITECTURE.md's table: the project packages each package may import.
ALLOWED = {
    "scheduler": set(),
    "kernels": set(),
    "engine": {"scheduler", "kernels"},
    "server": {"scheduler", "engine"},
    "bench": {"scheduler", "kernels", "engine", "server"},
    "benchmarks": {"scheduler", "kernels", "engine", "server", "bench"},
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
    assert any(i.top == "bench" for i in ALL_IMPORTS["benchmarks"])
    assert all(ALL_IMPORTS[p] for p in PACKAGES)


def test_the_project_is_imported_through_its_namespace():
    # An installed pagedserve has no top-level `kernels` or `server` (names other distributions
    # use: Hugging Face's `kernels` among them), so the code never imports them bare.
    bare = [
        f"{i.path}:{i.line} imports {i.module}"
        for p in PACKAGES
        for i in ALL_IMPORTS[p]
        if i.module.split(".")[0] in PRODUCT
    ]
    assert bare == []


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_table(package):
    bad = []
    for imp in ALL_IMPORTS[package]:
        if imp.top not in PACKAGES or imp.top == package:
            continue
        allowed = imp.top in ALLOWED[package]
        if imp.top == "bench" and not allowed:
            allowed = (
                (imp.lazy and imp.path in LAZY_BENCH_IMPORTERS)
                or imp.path.startswith("tests/bench/")
                or imp.path in BENCH_IMPORTERS_IN_TESTS
            )
        if imp.top == "benchmarks":  # the checkout's, not the wheel's: only its tests take it
            allowed = imp.path.startswith("tests/bench/")
        if not allowed:
            bad.append(f"{imp.path}:{imp.line} imports {imp.module}")
    assert bad == []


@dataclass(frozen=True)
class Rooms:
    """A package's rooms and what each may import. A room is a subfolder, or a top-level module
    that `top_level` names a room; the package's other top-level modules are shared: a room may
    import those listed in `shared` (and its own room's modules), and they import only each other.
    Beyond its row of `allowed`, a room may import the single modules `also` lists for it, and the
    files in `unbound` import any room."""

    package: str
    allowed: dict[str, set[str]]  # room -> the rooms it may import
    shared: set[str]
    top_level: dict[str, str] = field(default_factory=dict)  # top-level module -> its room
    also: dict[str, set[str]] = field(default_factory=dict)  # room -> modules of other rooms
    unbound: set[str] = field(default_factory=set)  # paths

    def room(self, path_or_module: str) -> str | None:
        """The room of a file or module of the package (None: shared, or not in the package)."""
        module = path_or_module.removesuffix(".py").replace("/", ".")
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        return parts[1] if len(parts) > 2 else self.top_level.get(module)

    def targets(self, imp: Import) -> set[str]:
        """The package's modules an import takes: `from pagedserve.engine.models import x` (or
        `from pagedserve.engine import models`) takes the module engine.models.x (engine.models)."""
        folders = set(self.allowed) - set(self.top_level.values())
        packages = {self.package, *(f"{self.package}.{room}" for room in folders)}
        taken = {m for m in imp.modules if m != imp.project}
        return taken if imp.project in packages and taken else {imp.project}

    def may_import(self, path: str, target: str) -> bool:
        room, target_room = self.room(path), self.room(target)
        if target in self.shared or target_room == room:
            return True
        if room is None or target_room is None:  # shared modules import only shared ones
            return False
        return (
            target_room in self.allowed[room]
            or target in self.also.get(room, set())
            or path in self.unbound
        )

    def bad_imports(self) -> list[str]:
        return [
            f"{imp.path}:{imp.line} imports {target}"
            for imp in ALL_IMPORTS[self.package]
            if imp.path != f"{self.package}/__init__.py" and imp.top == self.package
            for target in self.targets(imp)
            if not self.may_import(imp.path, target)
        ]


# engine/'s rooms (ARCHITECTURE.md): each may import the engine modules shared by all (at engine/'s
# top level) and the rooms below it, down this table; the front end only the light modules of the
# others (configs, the tokenizer, the core process's entry point), except in the modules that run
# a core in the caller's process.
ROOM_ALLOWED = {
    "models": set(),
    "lora": {"models"},
    "worker": {"lora", "models"},
    "core": {"worker", "lora", "models"},
    "frontend": set(),
}
ENGINE_SHARED = {
    "engine.engine_config", "engine.config_groups", "engine.options", "engine.messages",
    "engine.structured_output",
    "engine.cpu_allocator", "engine.tp_endpoint", "engine.kv_events_config",
}  # fmt: skip
FRONT_END_MAY_IMPORT = {
    "engine.models.model_config", "engine.models.hf_config", "engine.models.gguf_config",
    "engine.models.builtin_shapes", "engine.models.model_source", "engine.models.tokenizer",
    "engine.models.whisper_config", "engine.models.bert_config", "engine.core.process",
    "engine.core.beam_search", "engine.lora.request", "engine.lora.adapter",
}  # fmt: skip
IN_PROCESS_FRONT_END = {"engine/frontend/llm_engine.py", "engine/frontend/async_engine.py"}
ENGINE_ROOMS = Rooms(
    "engine", ROOM_ALLOWED, ENGINE_SHARED,
    also={"frontend": FRONT_END_MAY_IMPORT}, unbound=IN_PROCESS_FRONT_END,
)  # fmt: skip


def _room(path_or_module: str) -> str | None:
    """The room of an engine file or module (None: shared, or not in engine/)."""
    return ENGINE_ROOMS.room(path_or_module)


def test_engine_rooms_import_down_their_table():
    assert ENGINE_ROOMS.bad_imports() == []


# server/'s rooms: a room per API family (openai, anthropic, audio, embeddings) and per
# integration (metrics, lora, ray_serve), each a subfolder; at the top level the app (its
# construction, process, command line and config: it imports the API rooms to register their
# routes), what the handlers share (serving_common.py: the server's state, queueing, SSE) and
# the edge every room may import (errors, limits, the request bodies' base). API rooms import
# the shared handler code, not each other, except Anthropic's Messages, which run on OpenAI's
# chat path.
SERVER_ROOM_ALLOWED = {
    "metrics": set(),
    "lora": set(),
    "common": {"metrics", "lora"},  # the handlers' state holds the metrics and the adapters
    "openai": {"common"},
    "embeddings": {"common"},
    "audio": {"common", "metrics"},
    "anthropic": {"common", "openai"},
    "app": {"common", "metrics", "lora", "openai", "anthropic", "audio", "embeddings"},
    "ray_serve": {"app"},  # replicas of the app, each running the process the CLI runs
}
SERVER_ROOMS = Rooms(
    "server",
    SERVER_ROOM_ALLOWED,
    shared={"server.errors", "server.limits", "server.request_body"},
    top_level={
        "server.serving_common": "common",
        **dict.fromkeys(
            ("server.app", "server.api_server", "server.cli", "server.server_config",
             "server.dashboard", "server.launch"),
            "app",
        ),
    },
)  # fmt: skip


def test_server_rooms_import_down_their_table():
    assert SERVER_ROOMS.bad_imports() == []
    # Every top-level module is shared or in a room, and every room is in the table.
    top = {f"server.{p.stem}" for p in (ROOT / "server").glob("*.py")} - {"server.__init__"}
    assert top == SERVER_ROOMS.shared | set(SERVER_ROOMS.top_level)
    rooms = {p.parent.name for p in (ROOT / "server").glob("*/__init__.py")}
    assert rooms == set(SERVER_ROOM_ALLOWED) - set(SERVER_ROOMS.top_level.values())


# Guards the rules themselves: (rooms, file, module it imports, whether the table allows it).
ROOM_RULE_CASES = [
    (ENGINE_ROOMS, "engine/models/model.py", "engine.worker.kv_cache", False),
    (ENGINE_ROOMS, "engine/worker/sampler.py", "engine.core.engine_core", False),
    (ENGINE_ROOMS, "engine/frontend/process_client.py", "engine.models.model", False),
    (ENGINE_ROOMS, "engine/messages.py", "engine.models.model_config", False),
    (ENGINE_ROOMS, "engine/core/engine_core.py", "engine.worker.model_runner", True),
    (ENGINE_ROOMS, "engine/frontend/llm_engine.py", "engine.core.engine_core", True),
    (SERVER_ROOMS, "server/audio/serving_transcriptions.py", "server.openai.protocol", False),
    (SERVER_ROOMS, "server/openai/serving_chat.py", "server.anthropic.protocol", False),
    (SERVER_ROOMS, "server/errors.py", "server.serving_common", False),
    (SERVER_ROOMS, "server/serving_common.py", "server.app", False),
    (SERVER_ROOMS, "server/app.py", "server.ray_serve", False),
    (SERVER_ROOMS, "server/lora/serving_lora.py", "server.serving_common", False),
    (SERVER_ROOMS, "server/anthropic/serving_messages.py", "server.openai.serving_chat", True),
    (SERVER_ROOMS, "server/openai/serving_chat.py", "server.serving_common", True),
    (SERVER_ROOMS, "server/ray_serve/__init__.py", "server.api_server", True),
    (SERVER_ROOMS, "server/embeddings/serving_embeddings.py", "server.errors", True),
]


@pytest.mark.parametrize(("rooms", "path", "module", "allowed"), ROOM_RULE_CASES)
def test_the_room_rules_refuse_what_they_should(rooms, path, module, allowed):
    assert rooms.may_import(path, module) is allowed


# What the API server's process may load of engine/.
FRONT_END_LOADS = FRONT_END_MAY_IMPORT
SERVER_PROCESS_IMPORTS = (
    "pagedserve.server.cli", "pagedserve.server.api_server",
    "pagedserve.engine.frontend.process_client", "pagedserve.engine.frontend.data_parallel",
)  # fmt: skip


def test_the_api_servers_process_loads_no_model_worker_or_core_code():
    # The model, the worker and the core load in the core's process (and in the server's only
    # with --no-core-process).
    script = (
        f"import sys\nimport {', '.join(SERVER_PROCESS_IMPORTS)}\n"
        "print(*sorted(m for m in sys.modules if m.startswith('pagedserve.engine')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = {m.removeprefix(f"{NAMESPACE}.") for m in done.stdout.split()}
    assert "engine.frontend.process_client" in loaded  # the scan itself works
    heavy = sorted(
        m for m in loaded if _room(m) and _room(m) != "frontend" and m not in FRONT_END_LOADS
    )
    in_process = sorted(m for m in loaded if m.replace(".", "/") + ".py" in IN_PROCESS_FRONT_END)
    assert (heavy, in_process) == ([], [])


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
    "kernels/triton_lora.py",
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
    outside = {
        (i.path, i.lazy)
        for i in product
        if i.path not in TRITON_MODULES and any(m.startswith("kernels.triton_") for m in i.modules)
    }
    assert outside == {("kernels/dispatch.py", True)}


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
        "engine/core/process.py",  # the entry point of the engine core's own process
        "engine/worker/tp_worker.py",  # the entry point of a tensor-parallel rank's process
        "tests/conftest.py",
        "benchmarks/compare_serve.py",
        "benchmarks/compare_transformers.py",
        "benchmarks/host_step.py",
        "benchmarks/quantized_cpu.py",
    }
