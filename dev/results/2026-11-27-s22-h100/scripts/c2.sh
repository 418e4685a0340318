#!/usr/bin/env bash
# Session 22, call 2: the bf16 logits test's errors against fp32; bench_grpo on .old22 (4c3e6ac) and this tree,
# alternating twice per shape.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 100) python3 -m pytest tests/test_generate.py -q -m gpu -p no:cacheprovider -k "fused_decoding_layers_on_gpu" -s 2>&1 | grep -E "ERRSTATS|FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in .old22 .; do (cd $t && timeout $(left 70) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO|rollout" | tail -2 | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/$r $t /"); done; done; done
date -u
