#!/usr/bin/env bash
# Session 42, call 8 (H200, call 7's machine): qlora_big.py Llama-3.1-8B 2x2048 ckpt off, nanotune and Unsloth; the
# tree's --fp8 ckpt-off step (ab2.py) on the same machine.
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 70 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
date -u
timeout 220 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:off:2x2048,unsloth:off:2x2048 --out $OUT/l8 2>&1 | grep -v Warn | tail -6
date -u
for i in 1 2; do STEPS=8 timeout 75 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl; done
date -u
