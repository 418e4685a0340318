#!/usr/bin/env bash
# Session 43, call 6 (H200): the GRPO rollout against its bandwidth bound at more rows (P prompts x 8), 128 new tokens.
set -uo pipefail; export PYTHONUNBUFFERED=1
date -u; mkdir -p $OUT
for cfg in smollm2-135m:2 smollm2-135m:8 smollm2-135m:32 qwen2.5-0.5b:2 qwen2.5-0.5b:8 qwen2.5-0.5b:32; do
  shape=${cfg%:*}; p=${cfg#*:}
  timeout 100 python3 scripts/bench/bench_grpo.py --shape $shape --tokenizer .gpu/tok --ignore-eos --prompts $p \
    --max-new-tokens 128 --steps 5 --warmup 2 --out $OUT/$shape-p$p.json 2>&1 | grep -E "^GRPO|Error|error" | tail -3
  date -u +%T
done
