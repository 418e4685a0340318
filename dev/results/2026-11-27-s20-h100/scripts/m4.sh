#!/usr/bin/env bash
# Session 20, call 4: GPU tests of the decoding kernels and RL at 5d53620 (programmatic dependent launch, _rstd's loads together, the epilogue's
# inputs first); bench_grpo on .old20 (a0ad827, the session's start) and this tree alternating twice, both shapes;
# gaps2.py on this tree.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 170) python3 -m pytest tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_sample.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 > $OUT/tests.txt; cat $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in .old20 .; do (cd $t && timeout $(left 50) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO|rollout" | tail -2 | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/$r $t /"); done; done; done
for s in qwen2.5-0.5b smollm2-135m; do timeout $(left 60) python3 .gpu/gaps2.py --shape $s --tokenizer $R/.gpu/tok 2>&1 | grep -v -E "Writing model|Warn|warn" | head -14 | tee -a $OUT/gaps2.txt; done
date -u
