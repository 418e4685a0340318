#!/usr/bin/env bash
# Session 34, call 4: NormsTable against the float64 reference on the GPU, HEAD (.mid) and the tree; test_kernels'
# DoRA and merge tests on the GPU in both trees
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 120 python3 .gpu/n1.py 2>&1 | tee $OUT/n1.txt
(cd .mid && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "dora or merge" 2>&1 | tail -4) | tee $OUT/t_old.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "dora or merge" 2>&1 | tail -15 | tee $OUT/t_new.txt
date -u
