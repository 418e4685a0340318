#!/usr/bin/env bash
# Session 38, call 1 (H200): LM-head chunk shapes and the fused y + r + L R^T (m1.py); the fp8 ckpt-off step's kernels (p2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 .gpu/m1.py 2>&1 | tee $OUT/m1.txt
date -u
TOP=60 timeout 150 python3 .gpu/p2.py fp8:off 2>&1 | grep -v Warn | tee $OUT/prof.txt
date -u
TOP=30 timeout 150 python3 .gpu/p2.py bf16:off 2>&1 | grep -v Warn | tee $OUT/prof_bf16.txt
date -u
