#!/usr/bin/env bash
# Session 33, call 2: the add_rms_norm kernel tests on the GPU with their failures; bench_grpo.py on the Gemma-2-2B
# shape, .mid (deff65f) against the tree, alternating; the GPU tests of generation, rollouts and sampling
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py -k add_rms_norm -rf --tb=line 2>&1 | grep -v "^\.\|^$" | head -40 | tee $OUT/kt.txt
root=$PWD
run() { local tree=$1 tag=$2; local d=.; [ $tree = old ] && d=.mid
  (cd $d && python3 scripts/bench/bench_grpo.py --shape gemma-2-2b --tokenizer $root/.gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/g2_${tree}_$tag.json 2>&1 | grep -E "GRPO|rollout|Error" | sed "s/^/gemma2 $tree $tag: /"); }
{ run old 1; run new 1; run old 2; run new 2; } 2>&1 | tee $OUT/ab.txt
date -u
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_generate.py tests/test_rollouts.py tests/test_sample.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
