#!/usr/bin/env bash
# Session 31, call 5: bench_grpo.py at 64 tokens, .mid (acdfee4) against the tree, alternating twice per shape; then
# the GPU tests of generation, rollouts and RL on the tree
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
for shape in qwen2.5-0.5b smollm2-135m; do for r in 1 2; do for tree in old new; do
  d=.; [ $tree = old ] && d=.mid
  (cd $d && python3 scripts/bench/bench_grpo.py --shape $shape --tokenizer /work/main/.gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/${shape}_${tree}_$r.json 2>&1 | grep GRPO | sed "s/^/$tree $r: /")
done; done; done 2>&1 | tee $OUT/ab.txt
date -u
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_rl_gpu.py tests/test_generate.py tests/test_gpu_model.py tests/test_rollouts.py tests/test_sample.py tests/test_decode_gemms.py 2>&1 | tail -4 | tee $OUT/tests.txt
date -u
