#!/usr/bin/env bash
# Session 30: the activation's terms as tensor-core products (own columns, K 16): tile sweep, then GPU tests
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
python3 .gpu/glub.py 2>&1 | grep -v Warn | tee $OUT/glub.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "activation or lowrank" 2>&1 | tail -2
date -u
