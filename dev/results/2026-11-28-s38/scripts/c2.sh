#!/usr/bin/env bash
# Session 38, call 2 (H200): the residual + adapter kernel: its GPU tests and the fp8 GPU tests; the fp8 ckpt-off
# step's kernels of the tree and of .mid (HEAD before it), and graphed steps alternating
set -uo pipefail; export PYTHONUNBUFFERED=1
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -W ignore tests/test_kernels.py -k residual_lowrank tests/test_fp8_gpu.py 2>&1 | tail -8 | tee $OUT/tests.txt
date -u
TOP=60 timeout 100 python3 .gpu/p2.py fp8:off 2>&1 | grep -v Warn > $OUT/prof.txt; head -30 $OUT/prof.txt
(cd .mid && TOP=60 timeout 100 python3 $ROOT/.gpu/p2.py fp8:off 2>&1 | grep -v Warn > $OUT/prof_mid.txt); head -30 $OUT/prof_mid.txt
date -u
for i in 1 2; do
  timeout 60 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
  timeout 60 python3 .gpu/ab2.py .mid fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
date -u
