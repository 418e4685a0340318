#!/usr/bin/env bash
# Session 21, call 2: the decoding SwiGLU GEMM's variants (swi.py): norm, pairing, swap, PDL.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 560 python3 .gpu/swi.py 2>&1 | tee $OUT/swi.txt
date -u
