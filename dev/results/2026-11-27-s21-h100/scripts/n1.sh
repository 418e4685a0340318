#!/usr/bin/env bash
# Session 21, call 1: skinny decoding GEMMs through TMA and/or with A and B swapped (wgmma), against the tree's
# kernels and cuBLAS (tma.py).
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 560 python3 .gpu/tma.py "qwen gate|up" "qwen down" "smol gate|up" "qwen q|k|v" 2>&1 | tee $OUT/tma.txt
date -u
