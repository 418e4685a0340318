#!/usr/bin/env bash
# Session 26 call 4: the NF4 kernels' change, step A/B on one machine (.base = HEAD a5df4fa, . = this tree)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for rep in 1 2; do
  for case in bf16:off fp8:off bf16:on+offload fp8:on+offload; do
    for tree in .base .; do
      timeout 90 python3 .gpu/ab.py $tree $case 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
    done
  done
done
date -u
timeout 150 python3 scripts/bench/bench_nf4.py 2>&1 | tail -30 | tee $OUT/bench_nf4.txt
date -u
