#!/usr/bin/env bash
# Session 41, call 1 (H200): the DoRA-with-dropout GPU test on 203506d's _LowRank; --fp8 on+offload re-timed
# (the tree, which keeps q|k|v's output out under --fp8, against a5f6d78 in .mid); the --fp8 ckpt-off step's profile.
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT; nvidia-smi --query-gpu=name,power.limit,driver_version --format=csv
timeout 150 python3 -m pytest -q -x tests/test_variants.py -k "cuda_dora or dora_dropout" -p no:cacheprovider 2>&1 | tail -5
for t in . .mid . .mid; do
  STEPS=6 timeout 75 python3 .gpu/ab2.py $t fp8:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
done
TOP=45 timeout 120 python3 .gpu/p2.py fp8:off 2>&1 | tee $OUT/prof_fp8_off.txt | head -70
date -u
