#!/usr/bin/env bash
# Session 31, call 1: the rollout's phases traced (x1.py), and bench_grpo.py's Qwen2.5-0.5B step at 64 tokens
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
python3 .gpu/x1.py --tokenizer .gpu/tok --shapes qwen2.5-0.5b,smollm2-135m 2>&1 | tee $OUT/x1.txt | grep -v "^ *$" | head -80
for i in 3; do python3 scripts/bench/bench_grpo.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/q$i.json 2>&1 | tail -1; done
date -u
