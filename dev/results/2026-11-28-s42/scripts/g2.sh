#!/usr/bin/env bash
# Session 42, call 7 (H200): the activation's terms (R's first chunk read once a strip, 16-row tiles; no None
# returned from a jit function, for triton 3.6), the tree against HEAD 3175224 (.mid): kernels (k3.py), their GPU
# tests, graphed steps alternating.
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT; nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv,noheader
for t in . .mid; do timeout 60 python3 .gpu/k3.py $t 2>&1 | grep '^{' | tee -a $OUT/k3.jsonl; done
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_lora.py tests/test_fp8_gpu.py -k "glu or lowrank or activation or mlp or MLP or residual" -rf --tb=line 2>&1 | grep -v "^\.\|Warn\|warn" | tail -6
date -u
for t in . .mid . .mid; do
  STEPS=8 timeout 75 python3 .gpu/ab2.py $t fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t bf16:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
for t in . .mid . .mid; do
  WARM=3 STEPS=10 timeout 45 python3 .gpu/ab4.py $t tinyllama 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  WARM=3 STEPS=10 timeout 45 python3 .gpu/ab4.py $t qwen2.5-0.5b 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
