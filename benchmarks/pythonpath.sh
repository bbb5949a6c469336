# Sourced from the repository root by benchmarks/gpu_engine.sh and benchmarks/gpu_kernels.sh: makes
# `pagedserve` importable from this checkout without installing it (the GPU machine can neither
# download nor build a wheel). pagedserve's modules are `pagedserve.engine`, ... (pyproject.toml's
# package-dir maps them to the folders here), so a scratch folder gets a `pagedserve/` whose
# subpackages are links to those folders, and goes first on PYTHONPATH.
PAGEDSERVE_LINKS=$(mktemp -d)
python3 - "$PAGEDSERVE_LINKS" <<'PY' || return 1
import os, sys, tomllib
root = sys.argv[1]
for name, folder in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].items():
    link = os.path.join(root, *name.split("."))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.abspath(folder), link)
PY
export PYTHONPATH="$PAGEDSERVE_LINKS${PYTHONPATH:+:$PYTHONPATH}"
