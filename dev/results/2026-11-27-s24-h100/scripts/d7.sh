#!/usr/bin/env bash
# Session 24, call 7: the graphed on+offload step's kernels, the session's start (.old24) and the tree, one machine
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
P=$PWD/.gpu/prof_on.py
export TOP=70
for t in .old24 . .old24 .; do
  (cd $t && timeout 100 python3 $P on+offload on 2>&1 | grep -v Warn | sed "s|^|$t |")
done | tee $OUT/prof2.txt
date -u
