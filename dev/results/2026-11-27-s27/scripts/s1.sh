#!/usr/bin/env bash
# Session 27 call 1: _scaled_mm fast accumulation on Llama-3.1-8B's fp8 shapes; profiles of the bf16 ckpt-off step (Llama, Qwen)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 .gpu/fastacc.py 2>&1 | tee $OUT/fastacc.txt
TOP=60 SHAPE=llama-3.1-8b timeout 150 python3 .gpu/p2.py bf16:off 2>&1 | tee $OUT/prof_llama.txt
TOP=60 SHAPE=qwen2.5-7b timeout 150 python3 .gpu/p2.py bf16:off 2>&1 | tee $OUT/prof_qwen.txt
date -u
