#!/usr/bin/env bash
# Session 20, call 10: after the review (GraphStep's warm-up and capture in one helper; k_hi and dmask named once
# in the decoding kernels): the step, decoding, rollout and RL GPU tests (bitsandbytes carried for the NF4 cases).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 560 python3 -m pytest tests/test_step.py tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
