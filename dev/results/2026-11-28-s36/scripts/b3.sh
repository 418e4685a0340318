#!/usr/bin/env bash
# Session 36, call 3: the terms kernels below MIN_TERM_ELEMENTS (t5.py); SmolLM2-135M 8x512 graphed steps with the
# threshold at 2^24 (the tree) and 2^22, alternating
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 90 python3 .gpu/t5.py 2>&1 | grep -v Warn | tee $OUT/t5.txt
for m in 16777216 4194304 4194304 16777216; do MTE=$m timeout 60 python3 .gpu/ab4.py . 2>&1 | grep '^{' | tee -a $OUT/ab_smollm.jsonl; done
date -u
