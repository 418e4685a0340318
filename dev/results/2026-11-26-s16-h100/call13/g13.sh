#!/usr/bin/env bash
# main after the merges: RL / rollout / generation GPU tests; where a GRPO rollout's wall time goes (cProfile of bench_grpo)
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 -m pytest tests/test_rl_gpu.py tests/test_rollouts.py tests/test_generate.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests.txt; tail -5 $OUT/tests.txt
timeout 120 python3 -m cProfile -o $OUT/grpo.prof scripts/bench/bench_grpo.py --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --shape qwen2.5-0.5b --steps 4 --warmup 2 --out /tmp/g.json 2>&1 | grep -E "^GRPO"
date -u
