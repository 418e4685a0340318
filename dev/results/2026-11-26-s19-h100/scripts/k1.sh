#!/usr/bin/env bash
# Session 19, call 1: skinny decoding GEMMs (cuBLAS vs Triton split-K) at 16 rows; GRPO rollouts on main, both shapes.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for s in qwen2.5-0.5b smollm2-135m; do timeout $(left 60) $G --shape $s --out $OUT/grpo_${s}_main.json 2>&1 | grep -E "^GRPO" | cut -c1-220; done
timeout $(left 400) python3 .gpu/skinny.py 16 2>&1 | tee $OUT/skinny16.txt | grep -v "^ERR" | cut -c1-400
grep -c ^ERR $OUT/skinny16.txt; grep ^ERR $OUT/skinny16.txt | head -3
date -u
