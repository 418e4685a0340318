#!/usr/bin/env bash
# Llama-3.1-8B QLoRA: one step at the predicted longest length (377856 tokens), batch 1, ckpt + offload
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
timeout 585 python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long none --longest 377856 --out $OUT/longest.json --time-budget 580 > $OUT/longest.txt 2>&1; tail -3 $OUT/longest.txt
date -u
