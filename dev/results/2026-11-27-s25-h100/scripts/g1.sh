#!/usr/bin/env bash
# Session 25: what is allocated at the peak of SmolLM2-135M 8x512 on+offload (and ckpt on without offload)
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for c in on+offload on; do timeout 150 python3 .gpu/mempeak.py smollm2-135m 8x512 $c 2>&1 | grep -v Warn | tee -a $OUT/mempeak.txt; done
date -u
