#!/usr/bin/env bash
# Session 38, call 3 (H200): fp8 GPU tests (with the residual test), the kernel's non-gpu tests on CUDA tensors;
# graphed fp8 ckpt-off steps of the tree and .mid alternating, with the GPU's power and clocks sampled every 100 ms
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -W ignore tests/test_fp8_gpu.py 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -W ignore tests/test_kernels.py -k residual_lowrank 2>&1 | tail -3 | tee -a $OUT/tests.txt
date -u
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader -lms 100 > $OUT/power.csv &
SMI=$!
for i in 1 2; do
  STEPS=10 timeout 80 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  date -u +%T.%N >> $OUT/marks.txt
  STEPS=10 timeout 80 python3 .gpu/ab2.py .mid fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  date -u +%T.%N >> $OUT/marks.txt
done
kill $SMI
date -u
