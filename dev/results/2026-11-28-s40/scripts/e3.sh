#!/usr/bin/env bash
# Session 40, call 3 (H200): o's output kept before q|k|v's, KEPT_FLOPS_PER_BYTE 6000. GPU tests of offload; graphed
# on+offload steps of the tree (.) against a5f6d78 (.mid); then qlora_big.py's Llama-3.1-8B 2x2048 beside Unsloth
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 -m pytest -q -m gpu tests/test_offload.py -x -p no:cacheprovider 2>&1 | tail -2
date -u
for t in . .mid . .mid; do
  WARM=3 STEPS=8 timeout 80 python3 .gpu/ab4.py $t llama-3.1-8b 2x2048 on+offload nf4 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
for s in tinyllama qwen2.5-0.5b; do for t in . .mid; do
  WARM=3 STEPS=10 timeout 45 python3 .gpu/ab4.py $t $s 4x2048 on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done; done
date -u
timeout 60 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
timeout 170 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:on+offload:2x2048,unsloth:on:2x2048 --out $OUT/l8 2>&1 | grep -v Warn | tail -6
date -u
