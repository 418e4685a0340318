#!/usr/bin/env bash
# Session 38, call 6 (H200): Llama-3.1-8B QLoRA 1 x 65536, ckpt on + offload, beside Unsloth's on (1 warm-up, 3 timed)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
date -u
timeout 400 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:on+offload:1x65536:1:3,unsloth:on:1x65536:1:3 --out $OUT/l8 2>&1 | grep -v Warn | tail -6
date -u
