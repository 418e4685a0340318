#!/usr/bin/env bash
# Session 20, call 9: the next launch allowed after the wait (the tree) or before it (early.py), alternating.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for r in 1 2 3; do for m in tree early; do timeout 80 python3 .gpu/early.py --mode $m --tokenizer $R/.gpu/tok 2>&1 | grep -E "rollout|Error|error" | tail -3 | tee -a $OUT/early.txt; done; done
date -u
