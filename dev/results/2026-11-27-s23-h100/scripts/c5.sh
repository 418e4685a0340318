#!/usr/bin/env bash
# Session 23, call 5: bench_grpo on the session's tree: both shapes at 64 new tokens (twice) and 128 (once).
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do
  timeout $(left 100) python3 scripts/bench/bench_grpo.py --shape $s --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/grpo${r}_$s.json 2>&1 | grep -E "^GRPO|Error" | sed "s/^/$r /" | tee -a $OUT/grpo.txt
done; done
for s in qwen2.5-0.5b smollm2-135m; do
  timeout $(left 100) python3 scripts/bench/bench_grpo.py --shape $s --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --max-new-tokens 128 --out $OUT/grpo128_$s.json 2>&1 | grep -E "^GRPO|Error" | sed "s/^/128 /" | tee -a $OUT/grpo.txt
done
date -u
