#!/usr/bin/env bash
# Session 41, call 6 (H200): Qwen2.5-7B QLoRA 2x2048 ckpt off beside Unsloth on one machine (qlora_big.py), and the
# tree's --fp8 ckpt-off step of that shape (ab2.py), for the --fp8 ratio of one machine
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 70 python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
timeout 200 python3 .anchors/qlora_big.py --run /tmp/q7 --cases nanotune:off:2x2048,unsloth:off:2x2048 --out $OUT/q7 2>&1 | grep -v Warn | tail -6
date -u
for i in 1 2; do SHAPE=qwen2.5-7b STEPS=8 timeout 75 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl; done
date -u
