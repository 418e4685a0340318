#!/usr/bin/env bash
# Session 25, call 2: GPU tests of offload (the FLOP rule, the capture-safe unlock); SmolLM2 8x512 with the rule
# (mode -1) against none kept; Llama-3.1-8B NF4 2x2048 on+offload with 2 or 3 kept tensors, alternating
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 90) python3 -m pytest tests/test_offload.py tests/test_lora.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
timeout $(left 60) python3 .gpu/keep_modes.py smollm2-135m 8x512 -1,0 2 2>&1 | grep -E "mode|Error" | tee -a $OUT/small.txt
timeout $(left 560) python3 .gpu/keep_modes.py llama-3.1-8b 2x2048 2,3 3 nf4 2>&1 | grep -E "mode|Error" | tee -a $OUT/llama.txt
date -u
