#!/usr/bin/env bash
# Session 39, call 7: the whole GPU suite with the token-sum layouts (4 workers, then what failed serially); the
# not-gpu tests of the changed files on this GPU machine
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
mkdir -p $OUT; date -u
timeout -s INT 240 python3 -m pytest -q -rfE -n 4 -m gpu -W ignore tests > $OUT/gpu.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/gpu.txt | cut -c1-200 | head -60; tail -1 $OUT/gpu.txt; date -u
timeout -s INT 150 python3 -m pytest -q -rfE --lf -m gpu -W ignore tests > $OUT/gpu_lf.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_lf.txt | cut -c1-250 | head -40; tail -1 $OUT/gpu_lf.txt; date -u
timeout -s INT 150 python3 -m pytest -q -rfE -n 16 -m "not gpu" -W ignore tests/test_lora.py tests/test_full.py tests/test_rl.py \
  tests/test_ux.py tests/test_kernels.py tests/test_train.py > $OUT/not_gpu.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/not_gpu.txt | head; tail -1 $OUT/not_gpu.txt; date -u
