#!/usr/bin/env bash
# Session 21, call 6: host or GPU bound? (hostgpu.py), both shapes, full and without the layers.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 400 python3 .gpu/hostgpu.py --tokenizer $R/.gpu/tok 2>&1 | grep -v -E "Writing model|Warn|warn" | tee $OUT/hostgpu.txt
date -u
