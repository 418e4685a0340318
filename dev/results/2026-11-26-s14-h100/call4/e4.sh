#!/usr/bin/env bash
# graphed QLoRA 8B bf16 vs fp8 (main) vs fp8 (tensor-wise patch); GRPO decode profiles (SmolLM2, Qwen); full FT Qwen profile
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
Q="python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none"
timeout $(left 110) $Q --out $OUT/q_bf16.json --time-budget $(left 105) 2>&1 | grep -E "^\| llama" | tail -2
timeout $(left 110) $Q --fp8 --out $OUT/q_fp8_main.json --time-budget $(left 105) 2>&1 | grep -E "^\| llama" | tail -2
patch -p1 < dev/patches/fp8-tensorwise-scales.patch > /dev/null && echo patched
timeout $(left 110) $Q --fp8 --out $OUT/q_fp8_patch.json --time-budget $(left 105) 2>&1 | grep -E "^\| llama" | tail -2
patch -p1 -R < dev/patches/fp8-tensorwise-scales.patch > /dev/null && echo unpatched
G="python3 scripts/bench/bench_grpo.py --tokenizer .anchors/tok --ignore-eos --profile --cache-dir /tmp/bc"
timeout $(left 80) $G --shape smollm2-135m --out /tmp/g1.json > $OUT/grpo_prof_D.txt 2>&1; grep -E "^GRPO|launched" $OUT/grpo_prof_D.txt
timeout $(left 80) $G --shape qwen2.5-0.5b --out /tmp/g2.json > $OUT/grpo_prof_B.txt 2>&1; grep -E "^GRPO|launched" $OUT/grpo_prof_B.txt
timeout $(left 100) python3 .gpu/prof_full.py --model /tmp/bc/qwen2.5-0.5b --tokenizer .anchors/tok --full --batch-size 8 --max-len 512 --max-steps 12 --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --out-dir /tmp/full_B > $OUT/full_prof.txt 2>&1; grep -E "tok/s|Self CUDA" $OUT/full_prof.txt | tail -4
date -u
