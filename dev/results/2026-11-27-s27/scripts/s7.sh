#!/usr/bin/env bash
# Session 27 call 7: the fused GLU backward's launch sweep (stages, tiles, warps) and its cost without the dots
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 .gpu/glb2.py 2>&1 | tee $OUT/glb2.txt
date -u
