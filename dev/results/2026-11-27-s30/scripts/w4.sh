#!/usr/bin/env bash
# Session 30: the GPU suite on the tree (RL's tests left out: rl.py is untouched), the new MLP tests first
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora.py -k "inside_the_activation or cuda_fused" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -5
timeout 450 python3 -m pytest tests -q -m gpu --ignore=tests/test_rl_gpu.py -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -20 > $OUT/tests.txt; tail -8 $OUT/tests.txt
date -u
