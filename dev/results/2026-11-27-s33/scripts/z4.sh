#!/usr/bin/env bash
# Session 33, call 4: z4.py, the kernels of a nine-launch rollout (Gemma-3-1B, Gemma-2-2B, Qwen3-4B) on the tree
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
python3 .gpu/z4.py 2>&1 | grep -v Warning | tee $OUT/z4.txt
date -u
