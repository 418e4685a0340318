#!/usr/bin/env bash
# Session 26 call 2: NF4 kernel variants (bf16 dequantize, NF4 -> e4m3), Llama-3.1-8B groups
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 500 python3 .gpu/nf4v.py 2>&1 | grep -v Warn | tee $OUT/nf4v.txt
date -u
