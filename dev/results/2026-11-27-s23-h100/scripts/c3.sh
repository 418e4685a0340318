#!/usr/bin/env bash
# Session 23, call 3: the merge's variants (mergebench2.py) and the LM head's GEMM (lmbench.py).
set -uo pipefail
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 300) python3 .gpu/mergebench2.py 2>&1 | grep -v Warn | tee $OUT/merge.txt
timeout $(left 120) python3 .gpu/lmbench.py 2>&1 | grep -v Warn | tee $OUT/lm.txt
date -u
