#!/usr/bin/env bash
# Session 23, call 6: DoRA's norms table at other tiles (normbench.py); GPU tests of the rollout's users of the merge
# (generation, rollouts, RL, LoRA, kernels' merge and DoRA tables) on the session's tree.
set -uo pipefail
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 80) python3 .gpu/normbench.py 2>&1 | grep -v Warn | tee $OUT/norms.txt
timeout $(left 400) python3 -m pytest tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py tests/test_lora.py tests/test_kernels.py tests/test_decode_gemms.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
