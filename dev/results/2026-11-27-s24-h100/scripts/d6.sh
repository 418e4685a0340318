#!/usr/bin/env bash
# Session 24, call 6: kept attention with one copy fork a layer: Llama-3.1-8B NF4 2x2048 on+offload, the session's
# start (.old24) and the tree alternating twice; the tree's graphed step by stream
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for i in 1 2; do
  for t in .old24 .; do
    (cd $t && timeout 100 python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt on+offload --long-shapes none --out $OUT/q_${t#.}_$i.json 2>&1 | grep "^|" | tail -1 | sed "s|^|$t $i: |")
  done
done | tee $OUT/ab.txt
P=$PWD/.gpu/prof_on.py
export TOP=6
(timeout 100 python3 $P on+offload on 2>&1 | grep -v Warn | sed "s|^|graphed |") | tee $OUT/prof_graphed.txt
date -u
