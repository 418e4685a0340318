#!/usr/bin/env bash
# Session 24, call 9: Llama-3.1-8B NF4 1x131072 on+offload, first and second step, attention kept or recomputed
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for m in keep recompute; do timeout 280 python3 .gpu/long2.py $m 2>&1 | grep step; done | tee $OUT/long2.txt
date -u
