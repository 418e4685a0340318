#!/usr/bin/env bash
# Session 24, call 4: the on+offload step's kernels, the session's start (.old24) and the tree (prof_on.py)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
P=$PWD/.gpu/prof_on.py
for t in .old24 .; do
  (cd $t && timeout 140 python3 $P on+offload on 2>&1 | grep -v Warn | head -40 | sed "s|^|$t |")
done | tee $OUT/prof.txt
date -u
