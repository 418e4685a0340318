#!/usr/bin/env bash
# Session 40, call 1 (H200): q|k|v's output kept for the recompute. GPU tests of offload and graphed steps; then
# on+offload graphed steps, the tree (.) against a5f6d78 (.mid), alternating twice, each its own process.
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest -q -m gpu tests/test_offload.py tests/test_step.py -x -p no:cacheprovider 2>&1 | tail -4
date -u
for t in . .mid . .mid; do
  WARM=3 STEPS=8 timeout 90 python3 .gpu/ab4.py $t llama-3.1-8b 2x2048 on+offload nf4 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
for s in tinyllama qwen2.5-0.5b; do for t in . .mid . .mid; do
  WARM=3 STEPS=10 timeout 60 python3 .gpu/ab4.py $t $s 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done; done
date -u
