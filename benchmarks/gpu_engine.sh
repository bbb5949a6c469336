#!/usr/bin/env bash
# The engine on the H200 (issue 5), as one script for the device tool:
#
#     bash benchmarks/wheels.sh pyzmq msgspec xgrammar soundfile soxr python-multipart  # once, here: writes .whl/ (fastapi, gguf, uvicorn's click, pyzmq, msgspec, xgrammar, Whisper's audio and forms, ...)
#     run(command="bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=590)
#
# Steps in order of importance, each under its own time limit so that one that hangs cannot take
# the others' time (limit / estimate on an H200; every step starts a fresh Python that imports
# torch and transformers, ~5-10 s, and most draw the 1B shape's dummy weights on the CPU, ~5-8 s):
#
#   env           20 s / ~8 s    versions, GPU, which of the wheels import.
#   correctness  110 s / ~70 s   tiny Llama and the Llama-3.2-1B shape, random weights: fp32 greedy
#                                tokens of 8 prompts x 32 = transformers' generate, CUDA graphs and
#                                eager; bf16 matches counted. Per shape 4 engines and 2 transformers
#                                models, weights drawn once; the first Triton compiles land here.
#   decode        80 s / ~45 s   1B bf16, batch 1 and 256 at ~1.1k context: 50 timed decode steps
#                                and 20 split by part, graphs then eager; then 10 profiled steps,
#                                eager then graphs (3 engine builds, weights drawn once).
#   offline      110 s / ~85 s   1B bf16, 256 x 512 in / 256 out: pagedserve (~5 s + start-up),
#                                transformers generate_batch on 64 of the requests (~16k tokens at
#                                ~1.2k tok/s: ~15 s), transformers generate at batch 256 (~10 s);
#                                three fresh subprocesses, ~20 s start-up each.
#   nano (qwen)   50 s / ~30 s   nano-vllm's workload (133,966 output tokens) on Qwen2.5-0.5B.
#   nano (llama)  55 s / ~35 s   the same on Llama-3.2-1B.
#   online        95 s / ~65 s   offline worker (512 x 512 in / 128 out, ~20 s), then a server
#                                (~25 s to healthy) and bench serve at concurrency 1 (16 requests),
#                                64 (256) and 256 (512).
#   spec          45 s / ~30 s   1B bf16, 2 engine builds (plain and n-gram drafts, both
#                                synchronous), weights drawn once: 16 greedy requests of 256
#                                repeating tokens in / 64 out, at batch 1 and 16, each way; then
#                                n = 4 seeded samples on shared blocks against 4 requests.
#   summary        -   / ~2 s
#   total        565 s of limits + ~15 s wheel install, nvidia-smi and summary: within the run's
#                timeout_s=590 above; ~380 s expected.
#
# ONLY="step ..." runs just those steps (and the summary). The mixture-of-experts step is left
# out of the default run, whose limits fill one command; run it as its own command:
#
#     run(command="ONLY=moe bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=150)
#
#   moe          120 s / ~70 s   tiny Qwen3-MoE fp32 greedy = transformers' generate, graphs and
#                                eager (the fused MoE kernel compiled); then offline throughput
#                                (256 x 512 in / 256 out, bf16) of a Qwen3-30B-A3B-shaped model
#                                with 4 of its 48 layers (dummy weights drawn on the CPU, ~15 s).
#
# and the structured outputs (issue 17), also on their own:
#
#     run(command="ONLY=structured bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=150)
#
#   structured   120 s / ~60 s   tiny Llama fp32 constrained greedy (regex, choice, JSON schema,
#                                grammar; xgrammar's Triton mask kernel) = the CPU engine's,
#                                graphs and eager; then the 1B shape bf16, 256 x 512 in, a regex
#                                constraint against free generation of the same token counts.
#
# and KV capacity (issue 18): swap preemption and the fp8 cache in the engine:
#
#     run(command="ONLY=kvcap bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=150)
#
#   kvcap        120 s / ~60 s   tiny Llama fp32 greedy with swap preemption (a pool too small
#                                for all, pinned host pool) = the CPU engine's, graphs and eager; fp8
#                                cache calibrated after capture: agreement with fp32; then the
#                                1B shape bf16, 256 x 512 in, fp8 cache against bf16 cache.
#
# and tensor parallelism (issue 19) through its distributed path:
#
#     run(command="ONLY=tp bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=150)
#
#   tp           120 s / ~60 s   tiny Llama fp32 greedy through the distributed path at one rank
#                                (NCCL group of one, collectives in the CUDA graphs) = the plain
#                                engine's, graphs and eager; two ranks when two GPUs are there;
#                                then the 1B shape bf16, 256 x 512 in, both paths' throughput
#                                (target: the distributed path < 3% slower).
#
# and Whisper (issue 21) behind /v1/audio/transcriptions:
#
#     run(command="ONLY=whisper bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=180)
#
#   whisper      150 s / ~80 s   whisper-tiny shape, peaked random weights saved by transformers:
#                                fp32 greedy tokens of 4 audio windows decoded together (Triton's
#                                kernels) = transformers' generate; then the whisper-large-v3
#                                shape, random weights, bf16, served: audio s per wall s at
#                                concurrency 1, 16 and 64 (4, 32 and 128 requests of one
#                                30 s window, 447 tokens each).
#
# and embeddings and the token rules (issue 38):
#
#     run(command="ONLY=embed bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=150)
#
#   embed        120 s / ~50 s   a 2-layer BERT, random weights saved by transformers: fp32
#                                embeddings of 32 prompts (up to 400 tokens) packed in the engine
#                                = transformers' BertModel on the CPU to 1e-4; the tiny Llama's
#                                fp32 greedy tokens under logit_bias, allowed_token_ids and
#                                min_tokens = the CPU engine's, graphs and eager; then BERT-base's
#                                shape bf16, 1024 prompts of 128-512 tokens: pagedserve's
#                                embedding tok/s against transformers' in padded batches of 64.
#
# and multi-LoRA (issue 39):
#
#     run(command="ONLY=lora bash benchmarks/gpu_engine.sh", carry=[".whl"], timeout_s=180)
#
#   lora         150 s / ~60 s   the Triton LoRA shrink/expand, fp32 and bf16, 96 tokens of 4
#                                adapters (ranks 8-64) and the base model = the per-token
#                                reference; the tiny Llama's fp32 greedy tokens with 2 adapters
#                                and the base model in one batch = the CPU engine's, graphs and
#                                eager; then llama-3.2-1b's shape bf16, 256 x 512 in / 128 out:
#                                4 adapters (rank 16) mixed in every step against the base alone.
#
# Writes under $OUT (the device tool's folder; docs/results/gpu_engine by hand): gpu.txt,
# commit.txt, <step>.jsonl (one JSON object per line), <step>.log, online_server.log and
# summary.txt. SMOKE=1 runs every step with --smoke on the CPU (tests/bench/test_gpu_engine_bench.py);
# PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/steps.sh docs/results/gpu_engine || exit
if [ -z "$SMOKE_FLAG" ]; then  # the smoke run has the test environment's packages
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
    else
        echo "no .whl/: run benchmarks/wheels.sh where pip reaches PyPI and carry .whl (gguf, fastapi, ... are missing)"
    fi
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
source benchmarks/pythonpath.sh || exit
export TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
    > "$OUT/gpu.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/gpu.txt"
{ git rev-parse HEAD 2>/dev/null && git status --porcelain --untracked-files=no 2>/dev/null; } \
    > "$OUT/commit.txt" || cat COMMIT > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"

failed=0
step() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local start=$SECONDS
    # timeout signals the whole process group: the server and workers a step started go too.
    timeout -k 10 "$limit" "$PY" -m benchmarks.gpu_engine "$@" $SMOKE_FLAG --out "$OUT" \
        > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
    if [ "$rc" != 0 ]; then
        failed=1
        tail -n 15 "$OUT/$name.log"
    fi
}

step env 20 env
step correctness 110 correctness
step decode 80 decode
step offline 110 offline
step nano_qwen 50 nano --model qwen2.5-0.5b
step nano_llama 55 nano --model llama-3.2-1b
step online 95 online
step spec 45 spec
if [ -n "${ONLY:-}" ]; then
    step moe 120 moe
    step structured 120 structured
    step kvcap 120 kvcap
    step tp 120 tp
    step whisper 150 whisper
    step embed 120 embed
    step lora 150 lora
fi
"$PY" -m benchmarks.gpu_engine summary --out "$OUT"
exit $failed
