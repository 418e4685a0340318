#!/usr/bin/env bash
# Session 39, call 9: what the token-sum layouts cost the exact Llama-3.1-8B NF4 step (2x2048, ckpt off, graphed): the tree
# (.) against 4f2d9ae (.mid), alternating
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
mkdir -p $OUT; date -u
for t in . .mid . .mid; do
  STEPS=10 timeout 70 python3 .gpu/ab2.py $t bf16:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
