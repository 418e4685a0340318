#!/usr/bin/env bash
# Session 21, call 7: the host's time in a rollout's decoding loop (hostprof.py), both shapes.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 300 python3 .gpu/hostprof.py --tokenizer $R/.gpu/tok --shapes smollm2-135m,qwen2.5-0.5b 2>&1 | grep -v -E "Writing model|Warn|warn" | tee $OUT/hostprof.txt
date -u
