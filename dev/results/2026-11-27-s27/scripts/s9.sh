#!/usr/bin/env bash
# Session 27 call 11 (and 12): 2-D tiled GLU backward diagnostic (tiles, tiles a program, a 16-wide product by tl.dot or by row-reductions)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 .gpu/tile2d.py 2>&1 | tee $OUT/tile2d.txt
date -u
