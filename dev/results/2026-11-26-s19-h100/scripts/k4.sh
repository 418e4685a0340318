#!/usr/bin/env bash
# Session 19, call 4: branch dec4 (.dec4: the five-launch decoding layers on today's main, launch configs retuned)
# GPU tests of its kernels and paths; the rollout under launch configurations against the nine-launch path.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
(cd .dec4 && timeout $(left 200) python3 -m pytest tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests_dec4.txt); cat $OUT/tests_dec4.txt
(cd .dec4 && timeout $(left 300) python3 ../.gpu/dsweep.py --tokenizer $PWD/.gpu/tok 2>&1 | grep -v Warn | tee $OUT/dsweep.txt)
date -u
