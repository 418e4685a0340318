#!/usr/bin/env bash
# Session 44, call C (H200): the small-model rows of docs/benchmarks.md's first table, its tree (c973559, .base) against
# today's, alternating, nanotune only (bench.py --cases nanotune --step-opts cuda_graphs=on)
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
git rev-parse --short HEAD
R=$PWD
run() {  # tree label shapes
  local d=$R; [ $1 = base ] && d=$R/.base
  (cd $d && timeout $(left 200) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --step-opts cuda_graphs=on \
     --shapes $3 --ckpt off,on+offload --out $OUT/$1_$2.json --time-budget $(left 195) 2>&1 | grep -E "^\| (smollm|tinyllama|qwen)" | sed "s/^/$1 $2 /")
}
for r in 1 2; do
  run base s$r smollm2-135m; run new s$r smollm2-135m
  run base tq$r tinyllama,qwen2.5-0.5b; run new tq$r tinyllama,qwen2.5-0.5b
  (( SECONDS > 330 )) && break
done 2>&1 | tee $OUT/summary.txt
date -u
