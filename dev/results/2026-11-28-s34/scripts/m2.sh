#!/usr/bin/env bash
# Session 34, call 2: the merge's and DoRA norms' kernels with W a tile ahead (the tree) against HEAD (.mid): kernel
# times (m2.py), GroupSampler rollouts alternating twice (z7.py), bench_grpo Qwen2.5-0.5B in both trees, GPU tests
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
root=$PWD
timeout 150 python3 .gpu/m2.py 2>&1 | tee $OUT/m2.txt
for r in 1 2; do
  (cd .mid && python3 $root/.gpu/z7.py old$r $OUT/old$r.json 2>&1 | tail -4)
  python3 .gpu/z7.py new$r $OUT/new$r.json 2>&1 | tail -4
done | tee $OUT/ab.txt
date -u
(cd .mid && timeout 100 python3 scripts/bench/bench_grpo.py --shape qwen2.5-0.5b --tokenizer $root/.gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/grpo_old.json 2>&1 | tail -5)
timeout 100 python3 scripts/bench/bench_grpo.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/grpo_new.json 2>&1 | tail -5
date -u
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_lora.py tests/test_variants.py tests/test_rollouts.py -k "merge or dora or merged or rollout" 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
