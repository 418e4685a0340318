#!/usr/bin/env bash
# Session 23, call 10: GPU tests of the final tree's rollout path (generation, rollouts, RL, LoRA, the kernels' merge
# and DoRA tables, decoding GEMMs).
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 -m pytest tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py tests/test_lora.py tests/test_kernels.py tests/test_decode_gemms.py tests/test_variants.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
