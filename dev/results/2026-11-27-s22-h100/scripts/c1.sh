#!/usr/bin/env bash
# Session 22, call 1: the normalizing GEMMs' input as the Scaled rows written by the GEMM before: GPU tests of the
# decoding kernels, sampling, generation, rollouts and RL; roll.py on .old22 (4c3e6ac) and this tree alternating.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 200) python3 -m pytest tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_generate.py tests/test_sample.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
for r in 1 2 3; do for t in .old22 .; do (cd $t && timeout $(left 90) python3 $R/.gpu/roll.py --tokenizer $R/.gpu/tok 2>&1 | grep -E "rollout|Error" | sed "s/^/$r /" | tee -a $OUT/roll.txt); done; done
date -u
