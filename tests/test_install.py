"""pagedserve installed as a user installs it: the wheel built from the checkout, in a fresh
virtual environment outside it, run from another folder (tests/dists.py builds and installs).

An editable install hides what a wheel leaves out, and what its top-level names collide with:
these tests see the package as site-packages holds it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import openai
import pytest

from pagedserve.server.launch import server_process
from tests.dists import (
    NAMESPACE,
    ROOT,
    _checkout_files,
    clean_env,
    scratch_venv,
    sdist_files,
    site_packages_of_the_tests,
    source_path,
    wheel_files,
)

PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
# The packages whose every file the code may read at run time (sources, headers, the dashboard).
RUNTIME = ("scheduler", "kernels", "engine", "server")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_wheel_installs_one_import_name(dists):
    tops = {name.split("/")[0] for name in wheel_files(dists.wheel)}
    assert tops == {NAMESPACE, dists.wheel.name.split("-py3")[0] + ".dist-info"}
    assert set(PACKAGE_DIR) == {f"{NAMESPACE}.{d}" for d in (*RUNTIME, "bench")}


def test_the_wheel_holds_every_file_of_the_runtime_packages(dists):
    installed = {source_path(n, PACKAGE_DIR) for n in wheel_files(dists.wheel)}
    checkout = {f for f in _checkout_files() if f.split("/")[0] in RUNTIME}
    # bench/'s modules too (the `pagedserve bench` command).
    checkout |= {f for f in _checkout_files() if f.startswith("bench/") and f.endswith(".py")}
    assert checkout - installed == set()
    # The files the compiled kernels and the dashboard need, by name (a glob may miss them).
    for needed in ("kernels/csrc/cpu_math.h", "kernels/csrc/cpu_kernels.h",
                   "kernels/csrc/cpu_attention.cpp", "kernels/csrc/cpu_decoder.cpp",
                   "server/dashboard.html"):  # fmt: skip
        assert needed in installed


def test_the_wheel_leaves_the_labs_benchmarks_out(dists):
    # benchmarks/ (the GPU harnesses, microbenchmarks, comparison runs) and the committed
    # results (docs/results/) stay in the checkout: the wheel ships what `pagedserve bench` runs.
    files = wheel_files(dists.wheel)
    assert f"{NAMESPACE}/bench/cli.py" in files
    left_in = [
        name
        for name in files
        if name.startswith((f"{NAMESPACE}/bench/gpu_", "benchmarks/"))
        or "/results/" in name
        or name.endswith((".json", ".png"))
    ]
    assert left_in == []


def test_the_sdist_holds_what_the_wheel_installs(dists):
    in_sdist = sdist_files(dists.sdist)
    from_wheel = {source_path(n, PACKAGE_DIR) for n in wheel_files(dists.wheel)} - {None}
    assert from_wheel - in_sdist == set()
    assert {"pyproject.toml", "README.md"} <= in_sdist


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory):
    """The bin folder of a fresh venv holding the wheel."""
    return scratch_venv(tmp_path_factory.mktemp("user-venv") / "venv", dists.wheel)


def test_the_installed_package_imports_beside_hugging_face_kernels(installed, tmp_path):
    # transformers integrates Hugging Face's `kernels` distribution (installed with it here):
    # pagedserve must neither shadow it nor be taken for it.
    code = (
        "import pagedserve.kernels, pagedserve.server.cli, kernels\n"
        "from transformers.integrations import hub_kernels\n"
        "print(pagedserve.kernels.__file__); print(kernels.__file__)\n"
        "print(hasattr(kernels, 'get_kernel'))\n"
    )
    done = subprocess.run(
        [str(installed / "python"), "-c", code], cwd=tmp_path, env=clean_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ours, theirs, hub_api = done.stdout.split()
    venv = installed.parent
    assert ours.startswith(str(venv)) and ours.endswith("pagedserve/kernels/__init__.py")
    assert theirs.startswith(site_packages_of_the_tests()), theirs
    assert hub_api == "True"


def test_the_installed_bench_command_lists_its_benchmarks(installed, tmp_path):
    done = subprocess.run(
        [str(installed / "pagedserve"), "bench", "--help"], cwd=tmp_path, env=clean_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "{throughput,serve,soak,quality}" in done.stdout, done.stdout


# Slow: tests/test_docker_replay.py serves from the same wheel in a scratch venv, from a folder
# outside the checkout (the image's home), in every run, and checks more (the prebuilt kernels,
# the image's user).
@pytest.mark.slow
def test_the_installed_server_answers_from_another_directory(installed, tmp_path):
    log = tmp_path / "server.log"
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    command = [str(installed / "pagedserve")]
    with server_process(
        ["--no-access-log"], log, command=command, cwd=workdir, env=clean_env(), timeout=180
    ) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=30, temperature=0
        )
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert "Traceback" not in log.read_text()


def _python_in_the_checkout(code: str, *flags: str) -> subprocess.CompletedProcess:
    """`python -c code` started in the checkout's root, which Python puts first on sys.path."""
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_a_checkout_run_module_keeps_hugging_face_kernels_importable():
    # `python -m benchmarks.X` from the checkout puts its root first on sys.path, where
    # kernels/ would shadow Hugging Face's `kernels` and transformers would fail to load models.
    done = _python_in_the_checkout(
        "import sys; assert sys.path[0] == ''\n"
        "import benchmarks, kernels\n"
        "from transformers.integrations import hub_kernels\n"
        "print(kernels.__file__)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(site_packages_of_the_tests()), done.stdout


def test_a_script_in_the_checkouts_root_imports_hugging_faces_kernels():
    # A user's script beside the README: nothing moves the root, and `import kernels` finds the
    # kernels/ folder first. sentence-transformers imports Hugging Face's `kernels` through
    # transformers, and failed there (`cannot import name 'CUDAProperties' from 'kernels'`).
    done = _python_in_the_checkout(
        "import sentence_transformers, kernels, pagedserve.kernels\n"
        "from kernels import CUDAProperties, get_kernel\n"
        "print(kernels.__file__); print(pagedserve.kernels.__file__)\n"
        "print(callable(get_kernel), callable(pagedserve.kernels.paged_attention))\n"
    )
    assert done.returncode == 0, done.stderr
    theirs, ours, callables = done.stdout.splitlines()
    assert theirs == str(Path(site_packages_of_the_tests(), "kernels", "__init__.py"))
    assert ours == str(ROOT / "kernels" / "__init__.py")
    assert callables == "True True"
    # Without an installed `kernels` (-S: no site-packages) the name is missing, as it would be
    # without the folder, and the error says what the folder is.
    done = _python_in_the_checkout("import kernels", "-S")
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "ModuleNotFoundError: No module named 'kernels' (the checkout's kernels/ folder is "
        "pagedserve.kernels)"
    ), done.stderr
