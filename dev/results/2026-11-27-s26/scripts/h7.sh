#!/usr/bin/env bash
# Session 26 call 7: GPU tests of the model, offload and step paths on the final kernels
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 215 python3 -m pytest tests/test_gpu_model.py tests/test_offload.py tests/test_step.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
