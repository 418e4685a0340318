#!/usr/bin/env bash
# Session 40, call 7 (H200): Llama-3.1-8B NF4 2x2048 --fp8 with checkpointing + offload, graphed: the tree (.)
# against a5f6d78 (.mid), each its own process (ab2.py: 2 warm-up, STEPS timed)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
for t in . .mid; do
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t fp8:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
