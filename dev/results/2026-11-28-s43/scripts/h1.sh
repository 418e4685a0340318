#!/usr/bin/env bash
# Session 43, call 1 (H200): where the exact bf16 Llama-3.1-8B NF4 ckpt-off step goes (p2.py), and Qwen2.5-7B's.
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
TOP=60 timeout 150 python3 .gpu/p2.py bf16:off 2>&1 | grep -v Warn
date -u
SHAPE=qwen2.5-7b TOP=40 timeout 150 python3 .gpu/p2.py bf16:off 2>&1 | grep -v Warn
date -u
