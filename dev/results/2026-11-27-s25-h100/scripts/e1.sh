#!/usr/bin/env bash
# Session 25, call 1: GPU tests of offload / step / model on the tree with o's output kept; then the small shapes'
# on+offload step with 0, 2, 3 kept tensors (none; attention; attention and o), alternating twice
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 150) python3 -m pytest tests/test_offload.py tests/test_step.py tests/test_gpu_model.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
for s in "tinyllama 4x2048" "smollm2-135m 8x512" "qwen2.5-0.5b 4x2048"; do
  timeout $(left 140) python3 .gpu/keep_modes.py $s 0,2,3 2 2>&1 | grep -E "mode|Error" | tee -a $OUT/small.txt
done
date -u
