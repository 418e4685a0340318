#!/usr/bin/env bash
# Session 29 call: where Llama-3.1-8B's NF4 2x2048 step goes on an H100 today, --fp8 and exact bf16, ckpt off
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
SHAPE=llama-3.1-8b timeout 300 python3 .gpu/p2.py fp8:off,bf16:off 2>&1 | grep -v Warn | tee $OUT/prof_llama.txt | cut -c1-160 | head -120
date -u
