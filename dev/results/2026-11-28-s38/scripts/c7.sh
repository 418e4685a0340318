#!/usr/bin/env bash
# Session 38, call 7 (H200): the final tree's GPU tests of what changed: the fp8 GPU tests, the kernel tests of the
# residual add and of the fused head (gpu and the CPU-style ones on CUDA tensors)
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -W ignore tests/test_fp8_gpu.py 2>&1 | tail -3 | tee $OUT/tests.txt
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m "gpu or not gpu" -W ignore tests/test_kernels.py -k "residual_lowrank or linear_cross_entropy or target_rows" 2>&1 | tail -3 | tee -a $OUT/tests.txt
date -u
