#!/usr/bin/env bash
# Llama-3.1-8B QLoRA long rows: 131072 and 262144 at batch 1 (ckpt + offload)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
timeout 580 python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long 131072,262144 --no-longest --out $OUT/long.json --time-budget 570 > $OUT/long.txt 2>&1; grep -E "^\|" $OUT/long.txt | tail -4
date -u
