#!/usr/bin/env bash
# The H200 measurements of the Triton kernels, as one script for the device tool:
#
#     run(command="bash bench/gpu_kernels.sh", timeout_s=570)
#
# Needs only torch + triton (both on the GPU machine). Writes the JSON lines and tables under
# $OUT (the device tool's folder that comes back; bench/results/gpu when run by hand):
#   kernels.jsonl / .txt        checks against the reference, then decode / prefill times against
#                               SDPA, cache / copy_blocks / fused-op times against the torch
#                               reference (do_bench median, L2 flushed before each call)
#   kernels_moe.jsonl / .txt    the fused MoE (Qwen3-30B-A3B, Mixtral-8x7B; 1, 16, 256 tokens):
#                               checks, then times against the reference and the dense layer of
#                               the same active size (~40 s expected)
#   kernels_graph.jsonl / .txt  decode again as CUDA-graph replays (no host launch cost)
#   kernels_sweep.jsonl / .txt  launch configurations (tile, warps, stages, rows, splits)
# Each step has its own time limit, so one that hangs cannot take the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
source bench/pythonpath.sh || exit
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" python3 -m pagedserve.bench.gpu_kernels "$@" --out "$OUT/$name.jsonl" 2> "$OUT/$name.txt"
    echo "$name: rc=$? in $((SECONDS - start)) s"
    tail -n 40 "$OUT/$name.txt"
}

step kernels 180 --only decode,prefill,cache,copy,fused
step kernels_moe 90 --only moe
step kernels_graph 90 --cuda-graph --only decode
step kernels_sweep 180 --sweep --only decode,prefill
