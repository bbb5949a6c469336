"""Every command README.md, BENCHMARKS.md and the peers' README show runs as written: its
arguments parse with the real parser (`pagedserve`, `python -m benchmarks.*`), its script
exists in the repository and is valid shell, its make target exists;
`python -m benchmarks.attention_cpu` runs whole, and each `python -m` module answers
`--help` in a fresh interpreter. And the repository is self-contained: no file of a clean
checkout names a path above its root, where a fresh clone has nothing.

Commands are found in code blocks (one per line, `\\` continuations joined) and in inline code
spans; a bare program name ("the `pagedserve` command") is a mention, not a command. Most of
these commands are bench's, hence this file's place under tests/bench/."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.server.cli import build_parser as pagedserve_parser
from tests.dists import _checkout_files
from tests.server.util import PAGEDSERVE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "BENCHMARKS.md", "benchmarks/peers/vllm_cpu/README.md")
_ENV = r"(?:[A-Z_]+=(?:<[^>]*>|\S+)\s+)*"
COMMAND = re.compile(rf"^{_ENV}(pagedserve|python3? -m|\.venv/bin/python -m|python|bash|make)\b")
# Placeholders the docs use for "a value of your choice".
PLACEHOLDERS = {"M": "smollm2-135m", "STEP": "env"}


def _doc_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
            # `\` continues a command; so does a synopsis line that starts with "[".
            block = re.sub(r"\\\n|\n\s+(?=\[)", " ", block)
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip()
                if COMMAND.match(line):
                    found.append((doc, " ".join(line.split())))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            span = " ".join(span.split())
            if COMMAND.match(span):
                found.append((doc, span))
    return sorted({(doc, command) for doc, command in found if " " in command})


COMMANDS = _doc_commands()


def _argv(command: str) -> list[str]:
    command = re.sub(rf"^{_ENV}", "", command)
    return [PLACEHOLDERS.get(token, token) for token in shlex.split(command)]


def _parse_pagedserve(argv: list[str]) -> None:
    parser = pagedserve_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        from pagedserve.bench.cli import build_parser as bench_parser

        args = bench_parser().parse_args(unknown + args.bench_args)
        if args.bench_command == "throughput":
            EngineConfig.from_cli_args(args)
        return
    assert unknown == [], f"unknown arguments {unknown}"
    if args.command in ("serve", "generate"):
        args.config_cls.from_cli_args(args)


def _synopsis_flags_exist(argv: list[str]) -> None:
    # `pagedserve serve [--model M] [--port 8000] ...`: every flag named is a flag of the command.
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        pagedserve_parser().parse_args([argv[0], "--help"])
    known = set(re.findall(r"--[a-z][a-z-]*", out.getvalue()))
    named = {token.strip("[]") for token in argv if token.startswith("[--")}
    assert named and named <= known, f"not flags of `pagedserve {argv[0]}`: {named - known}"


def test_the_docs_show_commands_of_every_kind():
    programs = {COMMAND.match(command).group(1) for _, command in COMMANDS}
    assert programs >= {"pagedserve", "python -m", "bash", "make"}, programs
    assert len(COMMANDS) >= 25, COMMANDS


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_documented_command_parses(doc, command):
    argv = _argv(command)
    program = argv[0]
    if program == "pagedserve":
        if any(token.startswith("[") for token in argv):
            _synopsis_flags_exist(argv[1:])
        elif "--help" in argv:
            with pytest.raises(SystemExit) as exit_info:
                _parse_pagedserve(argv[1:])
            assert exit_info.value.code == 0
        else:
            _parse_pagedserve(argv[1:])
    elif program in ("python", "python3", ".venv/bin/python"):
        assert argv[1] == "-m", (
            f"{doc}: run bench scripts as modules (python -m benchmarks.X): {command}"
        )
        assert argv[2].startswith(("pagedserve.", "benchmarks.", "tests.")), (
            f"{doc}: `python -m` runs this project's modules only ({command}); "
            "show the suite as `make test PYTEST_ARGS=...`"
        )
        module = importlib.import_module(argv[2])
        module.build_parser().parse_args(argv[3:])
    elif program == "bash":
        script = ROOT / argv[1]
        assert script.resolve().is_relative_to(ROOT), f"{doc}: {argv[1]} is outside the repository"
        assert script.is_file(), f"{doc}: no {argv[1]}"
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    else:
        assert program == "make"
        done = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


PYTHON_MODULES = sorted(
    {argv[2] for argv in map(_argv, (c for _, c in COMMANDS)) if argv[1:2] == ["-m"]}
)


# Runs each module as `python -m` does (runpy, as __main__, the checkout's root first on sys.path)
# and reports its exit code and what it printed. One interpreter for all: each would spend ~3 s
# of CPU importing torch, 11 of them a third of a minute of the suite.
_HELP_RUNNER = """
import contextlib, io, json, runpy, sys
report = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as exit_:
        code = exit_.code
    except Exception as exc:
        code = repr(exc)
    report[module] = [code, out.getvalue()]
print(json.dumps(report))
"""


def test_every_documented_module_answers_help_in_a_fresh_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", _HELP_RUNNER, *PYTHON_MODULES],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    failed = {
        module: (code, done.stderr[-1000:])
        for module, (code, out) in report.items()
        if code not in (0, None) or not out.startswith("usage: ")
    }
    assert failed == {}
    assert "benchmarks.transcriptions" in report and len(report) >= 10


def test_attention_cpu_runs_as_written():
    # The documented form; as a script (python benchmarks/attention_cpu.py) its folder came first
    # on the path and shadowed the kernels package.
    assert ("BENCHMARKS.md", "python -m benchmarks.attention_cpu") in COMMANDS
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.attention_cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "backends cpu,torch" in lines[0]
    rows = [line.split()[:3] for line in lines[2:]]
    assert rows == [
        [s, d, b] for s in ("decode", "prefill", "mixed") for d in ("fp32", "bf16")
        for b in ("cpu", "torch")
    ]  # fmt: skip
    assert all(line.endswith("1.00x") for line in lines[3::2])  # torch against itself


def test_pagedserve_help_lists_its_commands():
    done = subprocess.run([PAGEDSERVE, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "{serve,generate,kv-plan,bench}" in done.stdout


# A relative path that climbs: "../" at the start of a path, not inside one ("bench/../x" stays
# within) nor the end of an ellipsis (".../v1").
_CLIMB = re.compile(r"(?<![\w./$})\]])\.\./[^\s`'\"()<>\[\]{},;]*")


def _paths_outside(text: str, folder: Path) -> list[str]:
    """The climbing paths in `text` that leave the checkout. Each leaves it from the root, where
    the docs' commands run; one is kept only as a link from the file's own `folder` to a file or
    folder the checkout has (docs/ naming the README one level up)."""
    return [
        path
        for path in _CLIMB.findall(text)
        if not ((folder / path).resolve().is_relative_to(ROOT) and (folder / path).exists())
    ]


def test_the_outside_path_check_finds_what_it_should():
    up = ".."  # spelled apart, so that this file names no such path itself
    peer = f"{up}/shared/peers/vllm_cpu/side_by_side.sh"
    assert _paths_outside(f"PEER=$PEER bash {peer} (offline)", ROOT) == [peer]
    # From a subfolder too, where it names nothing the checkout has.
    assert _paths_outside(f"Not checked: `{up}/shared/...`", ROOT / "tests" / "bench") == [
        f"{up}/shared/..."
    ]
    assert _paths_outside(f"see [the README]({up}/README.md)", ROOT / "bench") == []
    assert _paths_outside('cd "$HERE/../../.."; base URL ".../v1"', ROOT) == []


def test_no_file_names_a_path_outside_the_repository():
    """A fresh clone has nothing beside it: scripts, docs and code name only what is inside
    (a peer engine's own install, say, comes in through an environment variable)."""
    files = _checkout_files()
    assert "BENCHMARKS.md" in files and len(files) > 100
    outside = []
    for name in files:
        data = (ROOT / name).read_bytes()
        if b"../" in data and b"\0" not in data[:8192]:  # text files only
            text = data.decode("utf-8", "replace")
            outside += [f"{name}: {p}" for p in _paths_outside(text, (ROOT / name).parent)]
    assert outside == []
