#!/usr/bin/env bash
# Session 24, call 5: the tree's on+offload step, graphed and eager: kernels by stream; the session's start eager
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
P=$PWD/.gpu/prof_on.py
export TOP=12
(timeout 100 python3 $P on+offload on 2>&1 | grep -v Warn | sed "s|^|graphed |") | tee $OUT/prof_graphed.txt
for t in .old24 .; do
  (cd $t && timeout 100 python3 $P on+offload off 2>&1 | grep -v Warn | head -14 | sed "s|^|$t eager |")
done | tee $OUT/prof_eager.txt
date -u
