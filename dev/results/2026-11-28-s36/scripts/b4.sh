#!/usr/bin/env bash
# Session 36, call 4: the README's CPU test command on a GPU machine (tests marked interpreter skip there), then the
# GPU tests outside test_kernels.py
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; mkdir -p $OUT
python3 -c "import xdist" 2>/dev/null && X="-n 12" || X=""
echo "xdist: ${X:-none}"
timeout 290 python3 -m pytest -q -p no:cacheprovider $X -m "not gpu" tests 2>&1 | grep -v "Warn\|warn" | tail -40 | tee $OUT/not_gpu.txt
date -u
timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/test_kernels.py --ignore=tests/test_kernels_decode.py 2>&1 | tail -25 | tee $OUT/gpu.txt
date -u
