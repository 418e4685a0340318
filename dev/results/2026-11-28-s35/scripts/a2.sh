#!/usr/bin/env bash
# Session 35, call 5: the GLU kernels with terms as pipelined strips (the tree) against HEAD (.mid): kernel times,
# outputs' digests, a tile sweep; the GPU tests of the activations and the LoRA MLP
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 .gpu/t3.py .mid 2>&1 | grep -v Warn | tee $OUT/t3_old.txt
SWEEP=1 timeout 200 python3 .gpu/t3.py . 2>&1 | grep -v Warn | tee $OUT/t3_new.txt
date -u
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "lowrank or glu or swiglu or geglu or activation" 2>&1 | tail -2 | tee $OUT/tests_kernels.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mlp or terms or fp8" 2>&1 | tail -2 | tee $OUT/tests_lora.txt
date -u
