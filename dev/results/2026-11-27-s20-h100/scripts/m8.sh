#!/usr/bin/env bash
# Session 20, call 8: launch settings of the five-launch layers with dependent launches (tune.py), both shapes.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 560 python3 .gpu/tune.py --tokenizer $R/.gpu/tok 2>&1 | grep -v -E "Writing model|Warn|warn" | tail -60 | tee $OUT/tune.txt
date -u
