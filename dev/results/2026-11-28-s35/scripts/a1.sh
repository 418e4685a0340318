#!/usr/bin/env bash
# Session 35, call 1: per-call-site profiles of today's Llama-3.1-8B NF4 step (2 x 2048, ckpt off, eager), bf16 and --fp8
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
TOP=70 timeout 280 python3 .gpu/p5.py fp8 bf16 2>&1 | grep -v Warning | tee $OUT/p5_llama.txt
SHAPE=qwen2.5-7b TOP=70 timeout 200 python3 .gpu/p5.py bf16 2>&1 | grep -v Warning | tee $OUT/p5_qwen.txt
date -u
