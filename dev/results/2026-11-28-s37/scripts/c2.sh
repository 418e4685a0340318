#!/usr/bin/env bash
# Session 37, call 2: NF4 -> e4m3 tiles, grid order, the table variant (n2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 400 python3 .gpu/n2.py 2>&1 | grep -v Warn | tee $OUT/n2.txt
date -u
