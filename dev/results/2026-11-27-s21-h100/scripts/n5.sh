#!/usr/bin/env bash
# Session 21, call 5: what each of a decoding layer's five launches costs inside a rollout (ablate.py), twice.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 500 python3 .gpu/ablate.py --tokenizer $R/.gpu/tok 2>&1 | grep -E "rollout|Error|error" | tee $OUT/ablate.txt
date -u
