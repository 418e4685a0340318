#!/usr/bin/env bash
# Session 33, call 5: the GPU suite on the final tree (RL's file apart, then it)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; mkdir -p $OUT
timeout 420 python3 -m pytest tests -q -m gpu --ignore=tests/test_rl_gpu.py -p no:cacheprovider -x 2>&1 | tail -5 | tee $OUT/suite.txt
timeout 150 python3 -m pytest tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/rl.txt
date -u
