#!/usr/bin/env bash
# Session 21, call 4: the norm weight's slice pipelined: a GroupSampler rollout (roll.py) of .old21 (9f0d1bd) and
# this tree alternating three times, each in its own process.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for r in 1 2 3; do for t in .old21 .; do (cd $t && timeout $(left 120) python3 $R/.gpu/roll.py --tokenizer $R/.gpu/tok 2>&1 | grep rollout | sed "s/^/$r /" | tee -a $OUT/roll.txt); done; done
date -u
