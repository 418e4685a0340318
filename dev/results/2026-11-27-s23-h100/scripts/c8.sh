#!/usr/bin/env bash
# Session 23, call 8: where a GroupSampler call's time goes (phases.py).
set -uo pipefail
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 200) python3 .gpu/phases.py --tokenizer .gpu/tok 2>&1 | grep -E "call|Error|error" | tee $OUT/phases.txt
date -u
