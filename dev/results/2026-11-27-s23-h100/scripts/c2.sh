#!/usr/bin/env bash
# Session 23, call 2: the look-ahead prefetch (a decoding kernel asks L2 for a later kernel's weight): rollouts in
# each mode, alternating twice; then the decoding GPU tests with the default mode.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for r in 1 2; do for m in 0 1 2 3 4 "2 --early"; do
  timeout $(left 80) python3 .gpu/roll3.py --tokenizer .gpu/tok --mode $m 2>&1 | grep -E "rollout|Error" | sed "s/^/$r /" | tee -a $OUT/roll.txt
done; done
timeout $(left 200) python3 -m pytest tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
