#!/usr/bin/env bash
# Session 40, call 4 (H200): the whole GPU suite on the tree (bitsandbytes installed), two workers
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 540 python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider 2>&1 | tee $OUT/gpu_suite.txt | tail -15
date -u
