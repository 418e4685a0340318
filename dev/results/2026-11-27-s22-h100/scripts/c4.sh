#!/usr/bin/env bash
# Session 22, call 4: what the stop check's sync every 16 decoding steps costs (roll2.py, SYNC_EVERY 16 and 1000
# alternating twice, Qwen2.5-0.5B); the merge kernel against alignment hints and wider column steps (mergebench.py).
set -uo pipefail
R=$PWD
left() { local l=$(( 400 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT

for r in 1 2; do for s in 16 1000; do SYNC_EVERY=$s TOK=$R/.gpu/tok timeout $(left 70) python3 .gpu/roll2.py 2>&1 | grep -E "rollout|Error" | sed "s/^/$r sync_every=$s /" | tee -a $OUT/roll.txt; done; done
date -u
