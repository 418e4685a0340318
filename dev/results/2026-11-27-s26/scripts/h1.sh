#!/usr/bin/env bash
# Session 26 call 1: where the --fp8 step's time goes (Llama-3.1-8B NF4 2x2048), graphed, beside bf16
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
git log --oneline -1
TOP=45 timeout 560 python3 .gpu/p1.py fp8:off,fp8:on+offload,bf16:off 2>&1 | grep -v Warn | tee $OUT/prof.txt
date -u
