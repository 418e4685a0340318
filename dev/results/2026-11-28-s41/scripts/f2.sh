#!/usr/bin/env bash
# Session 41, call 2 (H200): kernels (k1.py); then the tree against HEAD 203506d (.mid), graphed steps, each its
# own process, alternating (ab2.py: Llama-3.1-8B NF4 2x2048; ab4.py: TinyLlama 4x2048)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 120 python3 .gpu/k1.py 2>&1 | tee $OUT/k1.txt
for c in fp8:off bf16:off; do for t in . .mid . .mid; do
  STEPS=8 timeout 75 python3 .gpu/ab2.py $t $c 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done; done
for t in . .mid; do
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t fp8:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t bf16:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  timeout 75 python3 .gpu/ab4.py $t tinyllama 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
