#!/usr/bin/env bash
# One GPU session, run on the device machine from the repository root:
#   bash benchmarks/gpu_session.sh [SCRIPT.py] [its options]   (results in $OUT, else ./gpu_out)
# SCRIPT.py (a file in benchmarks/) defaults to gpu_check.py; it is given --out $OUT.
# That machine (Python 3.12, torch 2.11, triton 3.6) has numpy, networkx and tqdm but not PuLP or
# HiGHS: their wheels travel in .whl/ (ignored by git; `carry` it), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pulp==3.3.2 highspy==1.16.0
# The project is not pip-installed there: its folders are laid out as the package (pyproject's
# package-dir) under /tmp/pkg.
set -u
SCRIPT=gpu_check.py
case "${1:-}" in *.py) SCRIPT=$(basename "$1"); shift ;; esac
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/remat
cp -r remat/*.py /tmp/pkg/remat/
for d in core attention loss_head compat graph_capture solver runtime; do cp -r "$d" "/tmp/pkg/remat/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc;
  python3 -c "import torch, triton, pulp, highspy; print('torch', torch.__version__, 'triton', triton.__version__, 'pulp', pulp.__version__)"; } \
  2>&1 | tee "$OUT/machine.txt"
LOG="$OUT/${SCRIPT%.py}.log"
python3 -X faulthandler "benchmarks/$SCRIPT" --out "$OUT" "$@" 2>&1 | tee "$LOG"
echo "$SCRIPT exit status: ${PIPESTATUS[0]}" | tee -a "$LOG"
