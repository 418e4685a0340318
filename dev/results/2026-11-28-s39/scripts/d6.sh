#!/usr/bin/env bash
# Session 39, call 6: the fix's GPU tests (test_lora.py -m gpu, with the two new ones); the layout sweep
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
mkdir -p $OUT; date -u
timeout 200 python3 -m pytest -q -rfE -m gpu -W ignore tests/test_lora.py tests/test_full.py tests/test_variants.py > $OUT/gpu_lora.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/gpu_lora.txt | cut -c1-250; tail -1 $OUT/gpu_lora.txt; date -u
timeout 300 python3 .gpu/m5.py 2>&1 | tee $OUT/m5.txt | tail -60
date -u
