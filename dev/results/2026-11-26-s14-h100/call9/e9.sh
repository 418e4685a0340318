#!/usr/bin/env bash
# decoding kernels: GPU tests, GRPO step (SmolLM2 and Qwen2.5-0.5B shapes, profiled); Unsloth's GRPO and DPO on the Qwen shape; nanotune DPO Qwen
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 120) python3 -m pytest tests/test_kernels_decode.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -20 > $OUT/tests.txt; tail -3 $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer .anchors/tok --ignore-eos --profile --cache-dir /tmp/bc"
timeout $(left 70) $G --shape smollm2-135m --out /tmp/g1.json > $OUT/grpo_D.txt 2>&1; grep -E "^GRPO|launched" $OUT/grpo_D.txt
timeout $(left 70) $G --shape qwen2.5-0.5b --out /tmp/g2.json > $OUT/grpo_B.txt 2>&1; grep -E "^GRPO|launched" $OUT/grpo_B.txt
python3 .anchors/trl_methods.py --methods grpo,dpo --systems unsloth --configs B --tokenizer .anchors/tok --prompt-len 256 --completion-len 256 --out /tmp/p3 --deadline-s $(left 300) 2>&1 | grep -E "^\|" | tail -4; cp /tmp/p3/trl_methods_results.json $OUT/unsloth_B.json
M=/tmp/trl_methods_models
timeout $(left 60) python3 scripts/bench/bench_dpo.py --model $M/m_B --tokenizer .anchors/tok --out $OUT/nt_dpo_B.json --pairs-per-step 8 --prompt-len 256 --completion-len 256 -- --gradient-checkpointing 2>&1 | tail -2
date -u
