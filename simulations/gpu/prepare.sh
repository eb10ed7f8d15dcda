#!/usr/bin/env bash
# Prepare, here (with network and fedhog's .venv), what simulations/gpu/check.sh needs on a bare GPU machine that has
# no network: the wheels of simulations/gpu/wheels.txt for CPython 3.12 on manylinux x86-64, and the data cache of
# the quickstart (MNIST-1D and its Dirichlet partition, so that neither mnist1d nor datasets/pyarrow is needed there).
# Everything goes to .wheelhouse/ (ignored by git), which the device call carries; the total must stay under
# LIMIT_MIB (default 40: the device's 64 MiB holds the working tree too).
#
#   simulations/gpu/prepare.sh                                   # .wheelhouse/ for the GPU machine (Python 3.12)
#   PYTHON_VERSION=3.11 WHEELHOUSE=/tmp/wh311 simulations/gpu/prepare.sh   # the same set for this machine's Python
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELHOUSE=${WHEELHOUSE:-.wheelhouse}
LIMIT_MIB=${LIMIT_MIB:-40}
PYTHON=${PYTHON:-python}

mkdir -p "$WHEELHOUSE"
rm -f "$WHEELHOUSE"/*.whl
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$WHEELHOUSE" -r simulations/gpu/wheels.txt
expected=$(grep -cv '^\s*\(#\|$\)' simulations/gpu/wheels.txt)
found=$(find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$found" -ne "$expected" ]; then
    echo "prepare.sh: $found wheels in $WHEELHOUSE, expected $expected (simulations/gpu/wheels.txt)" >&2
    exit 1
fi

# The quickstart's data, generated and partitioned once here (fedhog.data caches both under $FEDHOG_CACHE).
FEDHOG_CACHE="$WHEELHOUSE/cache" "$PYTHON" - <<'EOF'
from fedhog.config import load_config
from fedhog.data import load_test_set, population_training_data

spec = load_config("fedhog/quickstart.toml").data_spec
population_training_data(spec)
load_test_set(spec)
EOF

total=$(du -cb "$WHEELHOUSE"/*.whl "$WHEELHOUSE"/cache/*.npz | tail -1 | cut -f1)
echo "prepare.sh: $found wheels ($(du -cb "$WHEELHOUSE"/*.whl | tail -1 | cut -f1) bytes) and the quickstart's data" \
     "cache ($(du -cb "$WHEELHOUSE"/cache/*.npz | tail -1 | cut -f1) bytes) in $WHEELHOUSE:" \
     "$(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') (limit ${LIMIT_MIB} MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "prepare.sh: $WHEELHOUSE is over ${LIMIT_MIB} MiB" >&2
    exit 1
fi
