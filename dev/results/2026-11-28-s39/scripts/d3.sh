#!/usr/bin/env bash
# Session 39, call 3: the fixed not-gpu tests on a GPU machine; the MLP test's failure against float64
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout -s INT 200 python3 -m pytest -q -rfE -n 8 -m "not gpu" -W ignore tests/test_rl.py tests/test_ux.py tests/test_real_run.py tests/test_softcap_attention.py > $OUT/fixed.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/fixed.txt | head; tail -1 $OUT/fixed.txt; date -u
timeout 240 python3 .gpu/m2.py 2>&1 | tee $OUT/m2.txt
date -u
