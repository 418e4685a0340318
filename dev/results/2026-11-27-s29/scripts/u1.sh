#!/usr/bin/env bash
# Session 29 call 1: last session's unverified GPU tests; attention backends at 7-9B; the step's drift over 20 steps
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_qlora.py -k "adapter_grads or folded" 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 150 python3 .gpu/attn.py 2>&1 | tee $OUT/attn.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > $OUT/smi.csv 2>&1 &
SM=$!
SHAPE=qwen2.5-7b STEPS=25 timeout 150 python3 .gpu/drift.py . 2>&1 | tail -2 | tee $OUT/drift.txt
kill $SM
date -u
