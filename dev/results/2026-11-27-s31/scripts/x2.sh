#!/usr/bin/env bash
# Session 31, call 3: bench_grpo.py's rollout split (x2.py) twice, and the sampler's phases (phases.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
for i in 1; do python3 .gpu/x2.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/x2_$i.json 2>&1 | grep -v Writing | tail -8; done 2>&1 | tee $OUT/x2.txt

date -u
