#!/usr/bin/env bash
# Session 41, call 3 (H200): the one-read kernel's tiles (k2.py); the fp8 ckpt-off step's kernels, tree and .mid (p2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout 200 python3 .gpu/k2.py 2>&1 | tee $OUT/k2.txt
TOP=30 timeout 120 python3 .gpu/p2.py fp8:off 2>&1 | tee $OUT/prof_tree.txt | grep -v Warn | head -14
(cd .mid && TOP=30 timeout 120 python3 ../.gpu/p2.py fp8:off 2>&1 | tee $OUT/prof_mid.txt | grep -v Warn | head -14)
date -u
