#!/usr/bin/env bash
# Session 38, call 5 (H200): one run, 2x2048: Llama-3.1-8B ckpt on (+offload) beside Unsloth's on; Qwen2.5-7B ckpt
# off and on beside Unsloth, and its --fp8 ckpt off (ab2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
timeout 100 python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
date -u
SHAPE=qwen2.5-7b STEPS=10 timeout 80 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
date -u
timeout 200 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:on+offload:2x2048,unsloth:on:2x2048 --out $OUT/l8 2>&1 | grep -v Warn | tail -6
date -u
timeout 250 python3 .anchors/qlora_big.py --run /tmp/q7 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 --out $OUT/q7 2>&1 | grep -v Warn | tail -12
date -u
