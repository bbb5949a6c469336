"""pagedserve as a user installs it: the wheel and the sdist built from a copy of the checkout,
and fresh virtual environments outside the checkout that hold the wheel and nothing else of
pagedserve (tests/test_install.py, tests/test_docker.py).

The scratch environments take their dependencies from the test environment (a .pth line naming
its site-packages), so nothing is downloaded: the wheel is the only thing a test installs. A .pth
line adds a folder to sys.path without reading the .pth files inside it, so the editable install
of the checkout (a finder started by its own .pth) stays out of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "pagedserve"


@dataclass(frozen=True)
class Dists:
    wheel: Path
    sdist: Path


def _checkout_files() -> list[str]:
    """The files a clean checkout has: tracked, or new and not ignored (a commit-to-be)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [f for f in listed.split("\0") if f and (ROOT / f).is_file()]


def build_dists(workdir: Path) -> Dists:
    """Copy the checkout's files to `workdir`/src (so no build/ or egg-info lands in the
    checkout, and nothing untracked gets in) and build there, offline with the test
    environment's setuptools: the wheel as `pip wheel .` does, the sdist through setuptools'
    PEP 517 hook (what `python -m build --sdist` calls)."""
    src, out = workdir / "src", workdir / "dist"
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    sdist_hook = f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"
    for command in ([*pip, "-q", "-w", str(out), "."], [sys.executable, "-P", "-c", sdist_hook]):
        done = subprocess.run(command, cwd=src, capture_output=True, text=True)
        assert done.returncode == 0, (
            f"{command} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    (wheel,) = out.glob("pagedserve-*.whl")
    (sdist,) = out.glob("pagedserve-*.tar.gz")
    return Dists(wheel, sdist)


def wheel_files(wheel: Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")}


def sdist_files(sdist: Path) -> set[str]:
    """Members of the sdist, without its top folder (pagedserve-VERSION/)."""
    with tarfile.open(sdist) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}


def source_path(installed: str, package_dir: dict[str, str]) -> str | None:
    """The checkout path of a file the wheel installs under the namespace
    (pagedserve/kernels/csrc/cpu_math.h -> kernels/csrc/cpu_math.h); None for metadata."""
    parts = installed.split("/")
    if parts[0] != NAMESPACE or len(parts) < 3:
        return None
    package = f"{NAMESPACE}.{parts[1]}"
    return "/".join([package_dir[package], *parts[2:]]) if package in package_dir else None


def site_packages_of_the_tests() -> str:
    return sysconfig.get_paths()["purelib"]


def scratch_venv(path: Path, wheel: Path) -> Path:
    """A new virtual environment at `path` with the wheel installed (no dependencies: those come
    from the test environment, see the module's docstring). Returns its bin folder."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True
    )
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "_pagedserve_test_dependencies.pth").write_text(site_packages_of_the_tests())
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run(
        [*install, "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True
    )
    return path / "bin"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what points Python at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, **extra}
