#!/usr/bin/env bash
# Session 40, call 2 (H200): Llama-3.1-8B QLoRA 1 x 65536 (1 warm-up, 2 timed), the tree (.) and a5f6d78 (.mid) with
# on+offload, beside Unsloth's on, through qlora_big.py on one checkpoint, each case its own process
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 120 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
date -u
timeout 150 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:on+offload:1x65536:1:2 --out $OUT/tree 2>&1 | grep -v Warn | tail -3
date -u
(cd .mid && timeout 150 python3 ../.anchors/qlora_big.py --run /tmp/l8 --cases nanotune:on+offload:1x65536:1:2 --out $OUT/mid 2>&1 | grep -v Warn | tail -3)
date -u
timeout 200 python3 .anchors/qlora_big.py --run /tmp/l8 --cases unsloth:on:1x65536:1:2 --out $OUT/unsloth 2>&1 | grep -v Warn | tail -3
date -u
