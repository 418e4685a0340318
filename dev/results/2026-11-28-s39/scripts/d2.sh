#!/usr/bin/env bash
# Session 39, call 2: the README's CPU test command on a GPU machine again (all but the compile checks), after the fixes;
# then the GPU suite (4 workers; what fails there again serially, to tell out-of-memory beside other workers from a failure)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; mkdir -p $OUT
timeout -s INT 240 python3 -m pytest -q -rfE -n 16 --dist loadgroup -m "not gpu" -W ignore \
  --ignore tests/test_kernels_compile.py tests > $OUT/not_gpu.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/not_gpu.txt | head -40; tail -1 $OUT/not_gpu.txt; date -u
timeout -s INT 200 python3 -m pytest -q -rfE -n 4 -m gpu -W ignore tests > $OUT/gpu.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/gpu.txt | cut -c1-160 | head -60; tail -1 $OUT/gpu.txt; date -u
timeout -s INT 120 python3 -m pytest -q -rfE --lf -m gpu -W ignore tests > $OUT/gpu_lf.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/gpu_lf.txt | cut -c1-200 | head -40; tail -1 $OUT/gpu_lf.txt; date -u
