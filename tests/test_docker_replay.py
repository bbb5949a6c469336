"""docker/Dockerfile.cpu's install steps replayed without Docker (no daemon or registry is
reachable here), and its entry point run as its user: the image's filesystem as the Dockerfile
builds it, in a scratch prefix.

What is replayed as written: `python -m venv /opt/venv` (a venv at PREFIX/opt/venv), the
project's install (`pip install --no-deps .`: the wheel `pip` builds from the same files,
tests/dists.py), the RUN that compiles the CPU kernels (run by `sh -c` with the build stage's
ENV, for this machine's level alone), then the final stage: its ENV, no compiler (CXX names
none), USER 10001:10001, WORKDIR /home/pagedserve (PREFIX/home/pagedserve), ENTRYPOINT + CMD
(with a free port for 8000).
What is not: the apt-get of g++ (this machine's g++ stands in) and the torch and dependency
layers, which come from the test environment instead of PyTorch's index and PyPI."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedserve.kernels import cpu_features
from pagedserve.server.launch import server_process
from tests.dists import clean_env, scratch_venv
from tests.test_docker import Instruction, _instructions

IMAGE_VENV = "/opt/venv"
LEVEL_VARIABLES = (cpu_features.ISA_ENV, "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


def _env(stage: list[Instruction], prefix: Path) -> dict[str, str]:
    """The stage's ENV values, /opt/venv moved under `prefix`, $PATH the machine's."""
    env: dict[str, str] = {}
    for instruction in (i for i in stage if i.keyword == "ENV"):
        for word in shlex.split(instruction.args):
            name, _, value = word.partition("=")
            value = value.replace("$PATH", "/usr/local/bin:/usr/bin:/bin")
            env[name] = value.replace(IMAGE_VENV, str(prefix) + IMAGE_VENV)
    return env


def _runs(stage: list[Instruction]) -> list[str]:
    return [i.args for i in stage if i.keyword == "RUN"]


@pytest.fixture(scope="module")
def image(dists) -> Iterator[Path]:
    """PREFIX, holding the image's /opt/venv and /home/pagedserve. Made with mkdtemp (not
    pytest's tmp_path, whose folders only root may enter) for the image's user to read."""
    build, final = _stages(_instructions("Dockerfile.cpu"))
    assert any("apt-get install" in run and " g++" in run for run in _runs(build))
    assert f"python -m venv {IMAGE_VENV}" in _runs(build)
    assert "pip install --no-deps . && rm -rf build ./*.egg-info" in _runs(build)
    (compile_kernels,) = (run for run in _runs(build) if "pagedserve.kernels.cpu_ops" in run)
    assert [i.args for i in final if i.keyword == "COPY"] == [
        f"--from=build {IMAGE_VENV} {IMAGE_VENV}"
    ]

    prefix = Path(tempfile.mkdtemp(prefix="pagedserve-image-"))
    prefix.chmod(0o755)
    try:
        scratch_venv(prefix / IMAGE_VENV.lstrip("/"), dists.wheel)
        # The compile RUN as written, for this machine's level only (`--levels`), to keep the
        # test short: the image builds every x86-64 level.
        env = clean_env(**_env(build, prefix))
        env.pop("PAGEDSERVE_CACHE_DIR", None)
        level = cpu_features.cpu_features().level
        done = subprocess.run(
            ["sh", "-c", f"{compile_kernels} --levels {level}"], env=env, cwd=prefix,
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield prefix
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def test_the_cpu_image_serves_as_its_user_with_the_compiled_kernels(image):
    final = _stages(_instructions("Dockerfile.cpu"))[-1]
    (user,) = (i.args for i in final if i.keyword == "USER")
    uid = int(user.partition(":")[0])
    (workdir,) = (i.args for i in final if i.keyword == "WORKDIR")
    (entrypoint,) = (i.exec_form() for i in final if i.keyword == "ENTRYPOINT")
    (cmd,) = (i.exec_form() for i in final if i.keyword == "CMD")
    assert entrypoint == ["pagedserve", "serve"] and cmd[cmd.index("--port") + 1] == "8000"
    home = image / workdir.lstrip("/")
    home.mkdir(parents=True)
    as_root = os.geteuid() == 0
    if as_root:  # useradd --create-home: the user owns its home
        os.chown(home, uid, uid)
    env = {  # a container's environment: the image's ENV and a home, nothing of this machine's
        **_env(final, image),
        "HOME": str(home),
        "CXX": str(image / "no-compiler-in-the-image"),
        # but the CPU level the suite runs at (PAGEDSERVE_CPU_ISA and what emulates it), as the
        # image would run on a CPU of that level: the prebuilt library above is that level's.
        **{k: v for k, v in os.environ.items() if k in LEVEL_VARIABLES},
    }
    log = image / "server.log"
    log.touch()
    log.chmod(0o666)
    serve_args = [a for a in cmd if a not in ("--port", "8000")]
    command = [str(image / IMAGE_VENV.lstrip("/") / "bin" / entrypoint[0])]
    if as_root:
        # As the image's user. This machine's Python lives under /root (mode 700), where the
        # image has /usr/local: the user may read and search any file (CAP_DAC_READ_SEARCH) but
        # writes only where uid 10001 may, which is what running as it checks.
        command = [
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *command,
        ]  # fmt: skip
    with server_process(
        ["--no-access-log", *serve_args], log, command=command, cwd=home, env=env, timeout=300
    ) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=30, temperature=0
        )
    text = log.read_text()
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert "prebuilt" in text and "torch reference" not in text, text[-3000:]
    # Nothing was compiled at run time: the user's kernel cache stays empty.
    assert not (home / ".cache" / "pagedserve" / "kernels").exists()
    if as_root:
        assert (home / ".cache" / "pagedserve").stat().st_uid == uid  # written as the user
