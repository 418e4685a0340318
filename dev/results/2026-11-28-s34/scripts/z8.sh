#!/usr/bin/env bash
# Session 34, call 5: bench_grpo's Qwen2.5-0.5B rollout split (z8.py); bench_grpo --profile on the tree
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 scripts/bench/bench_grpo.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/grpo.json 2>&1 | tail -2
timeout 150 python3 .gpu/z8.py 2>&1 | tail -8 | tee $OUT/z8.txt
timeout 120 python3 scripts/bench/bench_grpo.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --profile --out $OUT/grpo_prof.json > $OUT/prof.txt 2>&1; tail -40 $OUT/prof.txt | cut -c1-200
date -u
