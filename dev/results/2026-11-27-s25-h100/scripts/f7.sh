#!/usr/bin/env bash
# Session 25, call: the small-model on+offload rows, the session's start (.old25, fb15e96) and the tree, alternating
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for t in .old25 . .old25 .; do
  (cd $t && timeout $(left 140) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --step-opts cuda_graphs=on --shapes smollm2-135m,tinyllama,qwen2.5-0.5b --ckpt on+offload --out $OUT/small_$(basename $(pwd))_$SECONDS.json 2>&1 | grep -E "^\| (smollm2|tinyllama|qwen)" | sed "s|^|$t |")
done | tee $OUT/small.txt
date -u
