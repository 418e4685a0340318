#!/usr/bin/env bash
# Session 21, call 3: the norm weight's slice pipelined (_normed_tile): per-launch times and output hashes of the
# normalizing GEMMs (normg.py) for .old21 (the session's start, 9f0d1bd) and this tree alternating; GPU tests of the
# decoding kernels; bench_grpo on both trees alternating twice, both shapes.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for r in 1 2; do for t in .old21 .; do timeout $(left 60) python3 .gpu/normg.py $t 2>&1 | tee -a $OUT/normg.txt; done; done
timeout $(left 100) python3 -m pytest tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_generate.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 > $OUT/tests.txt; cat $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in .old21 .; do (cd $t && timeout $(left 60) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO|rollout" | tail -2 | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/$r $t /"); done; done; done
date -u
