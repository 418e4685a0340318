#!/usr/bin/env bash
# Session 21, call 8: the decoding step as one replay (the draw and its bookkeeping in the graph): GPU tests of
timeout $(left 170) python3 -m pytest tests/test_sample.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
# must match); bench_grpo once each, both shapes.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 470 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
# sampling, generation, rollouts and RL; roll.py on .old21 (9f0d1bd) and this tree alternating twice (tokens' hash
for r in 1 2; do for t in .old21 .; do (cd $t && timeout $(left 60) python3 $R/.gpu/roll.py --tokenizer $R/.gpu/tok 2>&1 | grep rollout | sed "s/^/$r /" | tee -a $OUT/roll.txt); done; done
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for s in qwen2.5-0.5b smollm2-135m; do for t in .old21 .; do (cd $t && timeout $(left 45) $G --shape $s --out $OUT/grpo_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | tail -1 | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/$t /"); done; done
date -u
