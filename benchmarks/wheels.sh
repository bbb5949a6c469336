#!/usr/bin/env bash
# The wheels the GPU machine lacks, with everything they depend on, for its Python 3.12 on x86-64
# Linux, into .whl/ at the checkout's root (ignored by git; about 7 MB): fastapi, uvicorn,
# pydantic, gguf, openai and click, and any package names given. Run here, where the registry is
# reachable, then carry .whl to the GPU machine (benchmarks/gpu_engine.sh installs it there):
#
#     bash benchmarks/wheels.sh pyzmq msgspec xgrammar soundfile soxr python-multipart
#
# numpy is left out: the GPU machine has its own, and a second copy on the path could shadow the
# one its torch was built against.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# pip's output only on failure: it warns about every location it reads otherwise.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    fastapi uvicorn pydantic gguf openai click "$@" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
rm -f .whl/numpy-*.whl
ls .whl
du -sh .whl
