#!/usr/bin/env bash
# Session 24, call 1: where a Llama-3.1-8B NF4 step's time goes with checkpointing on + offload, against off
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 400 python3 .gpu/prof_on.py on+offload,off on 2>&1 | grep -v Warning | tee $OUT/prof_on.txt
date -u
