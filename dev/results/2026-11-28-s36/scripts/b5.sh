#!/usr/bin/env bash
# Session 36, call 5: the README's CPU test command on a GPU machine, verbose, to name what fails there
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout -s INT 500 python3 -m pytest -v -p no:cacheprovider -n 16 -m "not gpu" -W ignore tests > $OUT/not_gpu_v.txt 2>&1
grep -c PASSED $OUT/not_gpu_v.txt; grep -E "FAILED|ERROR" $OUT/not_gpu_v.txt | sed 's/.* \(tests\/\)/\1/' | sort | uniq | head -60
tail -3 $OUT/not_gpu_v.txt
date -u
