#!/usr/bin/env bash
# Session 29: the GPU suite on the tree (RL's tests last)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 420) python3 -m pytest tests -q -m gpu --ignore=tests/test_rl_gpu.py -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -20 > $OUT/tests.txt; tail -8 $OUT/tests.txt
timeout $(left 170) python3 -m pytest tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -10 > $OUT/tests_rl.txt; tail -5 $OUT/tests_rl.txt
date -u
