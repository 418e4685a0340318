#!/usr/bin/env bash
# Session 29 call: the fused loss's chunk rows (512, the tree's, against 2048) at Qwen2.5-7B and Llama-3.1-8B NF4 2x2048
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for rows in 512 2048 512 2048; do SHAPE=qwen2.5-7b ROWS=$rows timeout 80 python3 .gpu/chunk.py bf16:off 2>&1 | tail -1 | tee -a $OUT/chunk.jsonl; done
for rows in 512 2048; do SHAPE=qwen2.5-7b ROWS=$rows timeout 80 python3 .gpu/chunk.py bf16:on+offload 2>&1 | tail -1 | tee -a $OUT/chunk.jsonl; done
for rows in 512 2048; do SHAPE=llama-3.1-8b ROWS=$rows timeout 80 python3 .gpu/chunk.py bf16:off 2>&1 | tail -1 | tee -a $OUT/chunk.jsonl; done
date -u
