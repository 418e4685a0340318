#!/usr/bin/env bash
# Session 24, call 3: GPU tests of the kept attention (offload, step, model); Llama-3.1-8B NF4 2x2048 on+offload,
# the session's start (.old24) and the tree alternating twice; then one 1x65536 step each.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest tests/test_offload.py tests/test_step.py tests/test_gpu_model.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -12 | tee $OUT/tests.txt
for i in 1 2; do
  for t in .old24 .; do
    (cd $t && timeout 100 python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt on+offload --long-shapes none --out $OUT/q_${t#.}_$i.json 2>&1 | grep "^|" | tail -1 | sed "s|^|$t $i: |")
  done
done | tee $OUT/ab.txt
for t in .old24 .; do
  (cd $t && timeout 120 python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long 65536 --no-longest --out $OUT/long_${t#.}.json 2>&1 | grep "^|" | tail -1 | sed "s|^|$t 64k: |")
done | tee $OUT/long.txt
date -u
