#!/usr/bin/env bash
# Session 27 call 5: SwiGLU launch sweep; an eager Qwen2.5-7B step's CUDA time by op and shapes
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 .gpu/sweep.py 2>&1 | tee $OUT/sweep.txt
timeout 200 python3 .gpu/p3.py > $OUT/p3.txt 2>&1; tail -5 $OUT/p3.txt
date -u
