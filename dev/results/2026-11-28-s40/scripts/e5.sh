#!/usr/bin/env bash
# Session 40, call 5 (H200): qlora_big.py's Qwen2.5-7B 2x2048, nanotune on+offload beside Unsloth's on (the tree)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 70 python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
timeout 200 python3 .anchors/qlora_big.py --run /tmp/q7 --cases nanotune:on+offload:2x2048,unsloth:on:2x2048 --out $OUT/q7 2>&1 | grep -v Warn | tail -6
date -u
