#!/usr/bin/env bash
# Qwen2.5-7B QLoRA 2x2048: nanotune vs Unsloth, ckpt off and on(+offload), one machine
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -2
python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q7 --deadline 520 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048,nanotune:on:2x2048 2>&1 | grep -E "^\|" | tail -8
date -u
