#!/usr/bin/env bash
# Session 19, call 7 (merged main with the five-launch decoding layers; .old19 = c41bb75, the session's start):
# GPU tests of decoding, sampling, rollouts and RL; bench_grpo old/new alternating twice on both random shapes;
# GRPO in TRL + PEFT (configs D, B: SmolLM2-135M and Qwen2.5-0.5B shapes).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 -m pytest tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_sample.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 > $OUT/tests.txt; tail -4 $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for s in qwen2.5-0.5b smollm2-135m; do for t in .old19 .; do (cd $t && timeout $(left 45) $G --shape $s --out $OUT/grpo${r}_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | cut -c1-200 | sed "s/^/$r $t /"); done; done; done
python3 .anchors/trl_methods.py --methods grpo --systems trl --configs D,B --tokenizer .anchors/tok --out /tmp/trl --deadline-s $(left 300) 2>&1 | grep -E "^\| (SmolLM2|Qwen)" | tail -4; cp /tmp/trl/trl_methods_results.json $OUT/trl.json
date -u
