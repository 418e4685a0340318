#!/usr/bin/env bash
# Session 43, call 7 (H200): five-launch against nine-launch decoding at 32 and 64 rows (P 4 and 8 prompts x 8).
set -uo pipefail; export PYTHONUNBUFFERED=1
date -u; mkdir -p $OUT
for cfg in qwen2.5-0.5b:8:nine smollm2-135m:8:nine qwen2.5-0.5b:4:five qwen2.5-0.5b:4:nine; do
  IFS=: read shape p mode <<< "$cfg"
  flag=""; [ $mode = nine ] && flag=--nine-kernel-decoding
  timeout 60 python3 scripts/bench/bench_grpo.py --shape $shape --tokenizer .gpu/tok --ignore-eos --prompts $p $flag \
    --max-new-tokens 128 --steps 5 --warmup 2 --out $OUT/$shape-p$p-$mode.json 2>&1 | grep -E "^GRPO|Error|error" | tail -3
  date -u +%T
done
