#!/usr/bin/env bash
# The H200 measurements of the Triton kernels, as one script for the device tool:
#
#     run(command="bash benchmarks/gpu_kernels.sh", timeout_s=570)
#
# Needs only torch + triton (both on the GPU machine). Writes the JSON lines and tables under
# $OUT (the device tool's folder that comes back; docs/results/gpu when run by hand):
#   kernels.jsonl / .txt        checks against the reference, then decode / prefill times against
#                               SDPA, cache / copy_blocks / fused-op times against the torch
#                               reference (do_bench median, L2 flushed before each call)
#   kernels_moe.jsonl / .txt    the fused MoE (Qwen3-30B-A3B, Mixtral-8x7B; 1, 16, 256 tokens):
#                               checks, then times against the reference and the dense layer of
#                               the same active size (~40 s expected)
#   kernels_graph.jsonl / .txt  decode again as CUDA-graph replays (no host launch cost)
#   kernels_sweep.jsonl / .txt  launch configurations (tile, warps, stages, rows, splits)
# Each step has its own time limit, so one that hangs cannot take the others' time.
#
# ONLY="step ..." runs just those steps. One request, one answer (issue 58) is left out of the
# default run, whose limits fill one command; run it as its own command:
#
#     run(command="ONLY=invariance bash benchmarks/gpu_kernels.sh", timeout_s=240)
#
#   invariance.jsonl / .txt     the default (batch-invariant) paged attention: one stream's queries
#                               bit for bit the same alone, among 63 other decodes, in mixed steps
#                               and in chunks (bf16 and fp32, plain and windowed + soft-capped);
#                               then decode (64 x 2048, 256 x 1024, 1 x 8192) and prefill steps
#                               timed against PAGEDSERVE_BATCH_VARIANT=1: the cost ratio
#                               (limit 200 s, ~60-90 s expected, most of it compiling)
#
# SMOKE=1 runs the steps with --smoke on the CPU under Triton's interpreter
# (tests/bench/test_gpu_kernels_bench.py); PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/steps.sh docs/results/gpu || exit
if [ -n "$SMOKE_FLAG" ]; then
    export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
fi
source benchmarks/pythonpath.sh || exit
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

step() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local start=$SECONDS
    timeout "$limit" "$PY" -m benchmarks.gpu_kernels "$@" $SMOKE_FLAG --out "$OUT/$name.jsonl" 2> "$OUT/$name.txt"
    echo "$name: rc=$? in $((SECONDS - start)) s"
    tail -n 40 "$OUT/$name.txt"
}

step kernels 180 --only decode,prefill,cache,copy,fused
step kernels_moe 90 --only moe
step kernels_graph 90 --cuda-graph --only decode
step kernels_sweep 180 --sweep --only decode,prefill
if [ -n "${ONLY:-}" ]; then
    step invariance 200 --invariance
fi
