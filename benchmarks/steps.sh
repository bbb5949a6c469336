# Sourced from the checkout's root by benchmarks/gpu_engine.sh and benchmarks/gpu_kernels.sh, with
# the script's default output folder as its argument: what both scripts set up (OUT, the
# interpreter PY, SMOKE_FLAG=--smoke under SMOKE=1) and `wanted STEP`, true when ONLY="step ..."
# is unset or names the step.
OUT=${OUT:-$1}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SMOKE_FLAG=
if [ "${SMOKE:-0}" = 1 ]; then
    SMOKE_FLAG=--smoke
fi

wanted() {
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]
}
