#!/usr/bin/env bash
# Session 27 call 2: the first half of the SmolLM2 GGUF to /tmp; the fp8 GPU tests that need no bitsandbytes, with fast accumulation
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
cp .gg1/p1 /tmp/gguf_p1 && ls -la /tmp/gguf_p1
timeout 200 python3 -m pytest tests/test_fp8_gpu.py tests/test_fp8_kernels.py -q -m gpu -p no:cacheprovider -k "not nf4" 2>&1 | grep -E "FAILED|passed|failed|Error|assert" | tail -12 | tee $OUT/tests.txt
date -u
