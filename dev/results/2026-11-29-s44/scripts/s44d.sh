#!/usr/bin/env bash
# Session 44, call D (H200): what is allocated at the peak of the Gemma-3-12B (and Llama-3.1-8B) QLoRA 2x2048 on+offload step
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 .gpu/mp12.py gemma-3-12b 2x2048 on+offload 2>&1 | tee $OUT/g12.txt | tail -45
timeout 150 python3 .gpu/mp12.py llama-3.1-8b 2x2048 on+offload 2>&1 | tee $OUT/l8.txt | tail -25
date -u
