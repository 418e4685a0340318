#!/usr/bin/env bash
# Session 22, call 6: the whole GPU suite on the session's final tree (bitsandbytes carried; datasets, trl and gguf
# not: their tests skip).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>&1 | tail -1; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider -x 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
