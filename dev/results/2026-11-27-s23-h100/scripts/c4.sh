#!/usr/bin/env bash
# Session 23, call 4: the merge's tiles (merge_config): GPU tests of the merge, mergebench2's tree line; then q | k | v's
# and o's split of K forced to 1 or 2 (roll4.py), alternating twice with the tree's.
set -uo pipefail
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 100) python3 -m pytest tests/test_kernels.py tests/test_lora.py -q -m gpu -k "merge" -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -4 | tee $OUT/tests.txt
timeout $(left 60) python3 .gpu/mergebench2.py 2>&1 | grep -E "^tree|mode 0 tf32x3 O64 I32|mode 0 tf32x3 O32 I128" | tee $OUT/merge.txt
for r in 1 2; do for m in "0 0" "1 0" "0 1" "1 1" "2 2"; do set -- $m
  timeout $(left 80) python3 .gpu/roll4.py --tokenizer .gpu/tok --split-qkv $1 --split-o $2 2>&1 | grep -E "rollout|Error" | sed "s/^/$r /" | tee -a $OUT/roll.txt
done; done
date -u
