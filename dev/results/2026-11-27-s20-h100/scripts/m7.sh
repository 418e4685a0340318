#!/usr/bin/env bash
# Session 20, call 7: the whole GPU suite on the final tree (bitsandbytes, datasets, trl carried).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
git log --oneline -1 2>/dev/null
timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -12 | tee $OUT/tests.txt
date -u
