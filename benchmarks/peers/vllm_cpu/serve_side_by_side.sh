#!/bin/bash
# Serving, one client for both: `vllm bench serve` (N requests, default 64, of 128 random ids in
# and 64 out, ignore_eos, C at a time, default 16) against `vllm serve`, then against
# `pagedserve serve`, in the same DTYPE (bfloat16 by default), one server at a time on PORT.
# Needs PEER (setup_venv.sh) and the checkout's .venv; runs from any folder.
source "$(dirname "$0")/env.sh" || exit 1
DTYPE=${DTYPE:-bfloat16}
C=${C:-16}
N=${N:-64}
PORT=${PORT:-8011}

wait_up() {
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
        sleep 1
    done
    return 1
}

bench() {  # $1: the served model's name, $2: the results' tag
    # From PEER, as side_by_side.sh says why.
    ( cd "$PEER" && exec "$PEER/venv/bin/vllm" bench serve --backend openai \
        --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model "$1" \
        --tokenizer "$PEER/smollm2-hf" --dataset-name random --random-input-len 128 \
        --random-output-len 64 --num-prompts "$N" --max-concurrency "$C" --ignore-eos \
        --save-result --result-dir "$PEER" --result-filename "serve_$2.json" ) \
        > "$PEER/serve_$2.log" 2>&1
    python3 - "$PEER/serve_$2.json" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]}: {d['output_throughput']:.1f} out tok/s, TTFT p50 {d['median_ttft_ms']:.0f} ms, "
      f"TPOT p50 {d['median_tpot_ms']:.1f} ms, ITL p99 {d['p99_itl_ms']:.0f} ms, failed {d.get('failed', 0)}")
PY
}

# Each server in a session of its own (setsid), so that the kill takes its workers too: a vLLM
# worker left running would take a core from pagedserve's turn.
( cd "$PEER" && exec setsid "$PEER/venv/bin/vllm" serve "$PEER/smollm2-hf" --host 127.0.0.1 \
    --port "$PORT" --max-model-len 2048 --dtype "$DTYPE" ) > "$PEER/vllm_serve.log" 2>&1 &
server=$!
wait_up || { echo "vllm serve did not start"; tail -5 "$PEER/vllm_serve.log"; }
bench "$PEER/smollm2-hf" "vllm_c$C"
kill -TERM -- "-$server" 2>/dev/null; wait "$server" 2>/dev/null; sleep 3

( exec setsid "$ROOT/.venv/bin/pagedserve" serve --host 127.0.0.1 --port "$PORT" \
    --max-model-len 2048 --dtype "$DTYPE" ) > "$PEER/ours_serve.log" 2>&1 &
server=$!
wait_up || { echo "pagedserve did not start"; tail -5 "$PEER/ours_serve.log"; }
bench smollm2-135m-instruct "pagedserve_c$C"
kill -TERM -- "-$server" 2>/dev/null; wait "$server" 2>/dev/null
