#!/usr/bin/env bash
# Session 22, call 3: the merge with vector loads and stores: GPU tests (merge, LoRA/DoRA, rollouts, RL, generation);
# bench_grpo on .oldfc (fc23975, the norm change) and this tree alternating twice per shape; one --profile run.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 200) python3 -m pytest tests/test_kernels.py tests/test_lora.py tests/test_rollouts.py tests/test_rl_gpu.py tests/test_generate.py tests/test_decode_gemms.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in .oldfc .; do (cd $t && timeout $(left 70) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO|rollout" | tail -2 | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/$r $t /"); done; done; done
for t in .oldfc .; do (cd $t && timeout $(left 80) $G --shape qwen2.5-0.5b --profile --out $OUT/prof_$(basename $(realpath .)).json > $OUT/prof_$(basename $(realpath .)).txt 2>&1; grep -iE "merge|table" $OUT/prof_$(basename $(realpath .)).txt | head -5); done
date -u
