#!/usr/bin/env bash
# Session 34, call 7: the GPU suite on the session's final tree (RL's file apart, then it); test_kernels.py's tests,
# which run on the GPU where there is one, whole
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; mkdir -p $OUT
timeout 400 python3 -m pytest tests -q -m gpu --ignore=tests/test_rl_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/suite.txt
timeout 100 python3 -m pytest tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/rl.txt
timeout 60 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/kernels.txt
date -u
