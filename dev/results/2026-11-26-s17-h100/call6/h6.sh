#!/usr/bin/env bash
# Session 17, call 6: branch combo (.wtc: the decoding attention on tensor cores + the two-kernel sampler) GPU tests;
# GRPO rollouts main vs combo, both shapes, twice alternating; rollout_parts on both; a profile of combo's Qwen rollout.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
(cd .wtc && timeout $(left 200) python3 -m pytest tests/test_kernels_decode.py tests/test_sample.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests_combo.txt); tail -5 $OUT/tests_combo.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in . .wtc; do (cd $t && timeout $(left 45) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | cut -c1-200 | sed "s/^/$r $t /"); done; done; done
for t in .wtc .; do (cd $t && timeout $(left 50) python3 $OLDPWD/.gpu/rollout_parts.py --shape qwen2.5-0.5b --tokenizer $OLDPWD/.gpu/tok 2>&1 | grep -v Warn | sed "s/^/$t /" | tee -a $OUT/parts.txt); done
(cd .wtc && timeout $(left 60) $G --shape qwen2.5-0.5b --steps 3 --warmup 2 --profile --out /tmp/p.json > $OUT/prof_combo_qwen.txt 2>&1); sed -n 3,20p $OUT/prof_combo_qwen.txt | cut -c1-100,150-230
date -u
