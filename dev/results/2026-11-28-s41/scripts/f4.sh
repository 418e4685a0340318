#!/usr/bin/env bash
# Session 41, call 4 (H200): the whole GPU suite on the tree; then the tree (rope_qkv with v's copy, the one read's
# e4m3 copy at 8 warps) against HEAD 203506d (.mid), graphed steps, alternating; the one-read kernel again (k2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 280 python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider tests 2>&1 | tail -4
date -u
for t in . .mid . .mid; do
  STEPS=8 timeout 75 python3 .gpu/ab2.py $t fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
for t in . .mid; do
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t fp8:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  WARM=3 STEPS=10 timeout 45 python3 .gpu/ab4.py $t tinyllama 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
