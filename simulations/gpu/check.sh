#!/usr/bin/env bash
# fedhog's GPU check: from a bare GPU machine (no network; Python 3.12 with PyTorch CUDA) to measured figures in one
# call of at most 8 minutes. Run simulations/gpu/prepare.sh here first; the device call carries .wheelhouse/.
#
#   simulations/gpu/check.sh           # on the GPU machine: CUDA against the CPU beside it
#   FEDHOG_GPU_CHECK_DEVICE=cpu simulations/gpu/check.sh --quick   # a dry run of the script itself, on a CPU
#   FEDHOG_GPU_CHECK_BUDGET=200 FEDHOG_GPU_CHECK_ONLY=pytest,rounds simulations/gpu/check.sh   # a rerun of two steps
#
# Steps, each time-boxed (`timeout`) inside one deadline (FEDHOG_GPU_CHECK_BUDGET seconds, default 480), each
# going on whether the one before failed: install the wheelhouse (--no-index --no-deps, only what the image lacks)
# and fedhog (--no-deps); `pytest -m "gpu or not slow" tests/test_gpu.py`; the quickstart on the device and on the
# CPU with the same seeds; bench_derivatives.py on the device; bench_rounds.py --scaling (the device's rows first,
# then the CPU's); bench_derivatives.py on the CPU; gradient_ms.py. Files go to $OUT when it is set (the device
# machine's return folder), else results/gpu-check/: check.log, summary.json (every step's status and the figures),
# pytest.xml, derivatives-<device>.json, derivatives-cpu.json, rounds.json, gradient-ms.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
PYTHON=${PYTHON:-python3}
WHEELHOUSE=$(realpath "${WHEELHOUSE:-.wheelhouse}")
OUT_DIR=${OUT:-$REPO/results/gpu-check}
BUDGET=${FEDHOG_GPU_CHECK_BUDGET:-480}
PRIVACY_SEED=${FEDHOG_GPU_CHECK_SEED:-20261204}
ONLY=${FEDHOG_GPU_CHECK_ONLY:-}  # e.g. "pytest,rounds": only these steps (and install)
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/fedhog-gpu-check.XXXXXX)
LOG=$OUT_DIR/check.log
STEPS=$WORK/steps.jsonl
: > "$LOG"
: > "$STEPS"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export FEDHOG_CACHE=${FEDHOG_CACHE_FOR_CHECK:-$WHEELHOUSE/cache}  # the quickstart's data, prepared and carried
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_HOME=$WORK/flwr-home RAY_TMPDIR=$WORK/ray
THREADS=$(nproc)
[ "$THREADS" -gt 16 ] && THREADS=16
[ "$QUICK" = 1 ] && THREADS=1

log() { echo "[check $(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }

# step NAME SECONDS STDOUT COMMAND...: COMMAND for at most SECONDS (less where the deadline is nearer), its stdout
# to STDOUT ("-": the log), its stderr to the log; the outcome is a line of $STEPS.
step() {
    local name=$1 want=$2 stdout=$3
    shift 3
    if [ -n "$ONLY" ] && [ "$name" != install ] && [[ ",$ONLY," != *",$name,"* ]]; then
        return 0  # FEDHOG_GPU_CHECK_ONLY names the steps to run (a rerun of those that failed)
    fi
    local left=$((DEADLINE - $(date +%s)))
    local limit=$((want < left ? want : left))
    if [ "$limit" -lt 5 ]; then
        log "$name: skipped, ${left}s left of the ${BUDGET}s budget"
        echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": true}" >> "$STEPS"
        return 0
    fi
    log "$name: up to ${limit}s: $*"
    local began rc
    began=$(date +%s%N)
    if [ "$stdout" = "-" ]; then  # bash -c: COMMAND may be one of the functions below (exported)
        timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >> "$LOG" 2>&1
    else
        timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" > "$stdout" 2>> "$LOG"
    fi
    rc=$?
    local ns seconds
    ns=$(($(date +%s%N) - began))
    seconds=$(printf "%d.%03d" $((ns / 1000000000)) $(((ns / 1000000) % 1000)))
    log "$name: rc=$rc after ${seconds}s"
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $seconds, \"limit\": $limit," \
         "\"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)}" >> "$STEPS"
}

install() {
    mkdir -p "$WORK/site"
    local missing
    missing=$("$PYTHON" - "$WHEELHOUSE" <<'EOF'
import importlib.metadata as metadata
import pathlib
import sys

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        print(f"kept the image's {name} {metadata.version(name)} (wheelhouse: {version})", file=sys.stderr)
    except metadata.PackageNotFoundError:
        print(wheel)
EOF
)
    local wheel
    # shellcheck disable=SC2086  # one wheel path a word
    if [ -n "$missing" ] && ! "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$WORK/site" $missing; then
        echo "pip could not install the wheelhouse: unpacking the wheels onto the path instead"
        for wheel in $missing; do "$PYTHON" -m zipfile -e "$wheel" "$WORK/site" || return 1; done
    fi
    if "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$WORK/site" "$REPO" \
            > "$WORK/fedhog-build.log" 2>&1; then
        echo "fedhog installed (--no-deps) into $WORK/site"
    else
        echo "fedhog not built here ($(grep -m1 -i 'error' "$WORK/fedhog-build.log")): it runs from the checkout"
    fi
    "$PYTHON" -c "import torch, flwr, dp_accounting, fedhog.engines.vectorized, fedhog.cli; print('imports:',
        'fedhog', fedhog.__version__, fedhog.__file__, 'flwr', flwr.__version__, 'torch', torch.__version__,
        'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
}

quickstart() {  # DEVICE FOLDER: the quickstart, privacy-seed fixed, on DEVICE
    local rounds=()
    [ "$QUICK" = 1 ] && rounds=(--set rounds=2)
    "$PYTHON" -m fedhog.cli run --engine vectorized --set "device=\"$1\"" --set "privacy-seed=$PRIVACY_SEED" \
        --set "results-dir=\"$2\"" "${rounds[@]}"
}

export REPO QUICK PYTHON WHEELHOUSE WORK PRIVACY_SEED
export -f install quickstart
log "fedhog GPU check in $REPO, output in $OUT_DIR, budget ${BUDGET}s, quick=$QUICK, python $("$PYTHON" -V 2>&1)"
step install 90 - install
DEVICE=${FEDHOG_GPU_CHECK_DEVICE:-$("$PYTHON" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
log "device: $DEVICE (the CPU beside it: $THREADS torch threads)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1

step pytest 90 - "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py -m "gpu or not slow" \
    --junitxml="$OUT_DIR/pytest.xml"
step "quickstart-$DEVICE" "$([ $QUICK = 1 ] && echo 60 || echo 75)" - quickstart "$DEVICE" "$WORK/quickstart-$DEVICE"
step quickstart-cpu-beside "$([ $QUICK = 1 ] && echo 60 || echo 90)" - quickstart cpu "$WORK/quickstart-cpu-beside"
DERIVATIVES=(--json --activation gelu --quick)
[ "$QUICK" = 1 ] && DERIVATIVES+=(--models mlp_15k)
step "derivatives-$DEVICE" 90 "$OUT_DIR/derivatives-$DEVICE.json" \
    "$PYTHON" simulations/bench_derivatives.py "${DERIVATIVES[@]}" --device "$DEVICE" --threads 1
# the rounds: what the deadline leaves, less 70 s for the steps after it
ROUNDS_BUDGET=$((DEADLINE - $(date +%s) - 70))
[ "$QUICK" = 1 ] && ROUNDS_BUDGET=15
[ "$ROUNDS_BUDGET" -gt 200 ] && ROUNDS_BUDGET=200
SCALING=("$DEVICE")
[ "$DEVICE" != cpu ] && SCALING+=(cpu)
ROUNDS=(--scaling "${SCALING[@]}" --json --threads "$THREADS" --budget "$ROUNDS_BUDGET")
[ "$QUICK" = 1 ] && ROUNDS+=(--quick)
step rounds "$((ROUNDS_BUDGET + 15))" "$OUT_DIR/rounds.json" "$PYTHON" simulations/bench_rounds.py "${ROUNDS[@]}"
if [ "$DEVICE" != cpu ]; then
    step derivatives-cpu 50 "$OUT_DIR/derivatives-cpu.json" "$PYTHON" simulations/bench_derivatives.py \
        "${DERIVATIVES[@]}" --models mlp_15k,cnn1d_40k --device cpu --threads "$THREADS"
fi
GRADIENT_DEVICES=("$DEVICE")
[ "$DEVICE" != cpu ] && GRADIENT_DEVICES+=(cpu)
step gradient-ms 20 "$OUT_DIR/gradient-ms.json" \
    "$PYTHON" simulations/gpu/gradient_ms.py --devices "${GRADIENT_DEVICES[@]}" --threads "$THREADS"
"$PYTHON" simulations/gpu/summarize.py --out "$OUT_DIR" --steps "$STEPS" --device "$DEVICE" \
    --quickstart "$WORK/quickstart-$DEVICE" --quickstart-cpu "$WORK/quickstart-cpu-beside" \
    --seconds "$(($(date +%s) - START))" 2>&1 | tee -a "$LOG"
rm -rf "$WORK"
