#!/usr/bin/env bash
# Session 44, call F (H200): one GRPO step at 128 new tokens, SmolLM2-135M shape (trl_methods' config D), 2 prompts x G 8:
# TRL + PEFT and Unsloth (trl_methods.py) and nanotune (bench_grpo.py) on the same random-init model, today's tree
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
T="--methods grpo --configs D --tokenizer .gpu/tok --max-completion-length 128 --warmup 2 --steps 5"
python3 .anchors/trl_methods.py $T --systems trl --out /tmp/trl --deadline-s $(left 200) --case-timeout-s 200 2>&1 | grep -E "^\| SmolLM2|Error" | tail -3; cp /tmp/trl/trl_methods_results.json $OUT/trl.json
M=/tmp/trl_methods_models; ls $M
timeout $(left 90) python3 scripts/bench/bench_grpo.py --model $M/m_D --tokenizer .gpu/tok --ignore-eos --max-new-tokens 128 --steps 5 --warmup 2 --out $OUT/nt_D.json 2>&1 | grep -E "^GRPO" | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-400
python3 .anchors/trl_methods.py $T --systems unsloth --out /tmp/uns --deadline-s $(left 200) --case-timeout-s $(left 200) 2>&1 | grep -E "^\| SmolLM2|Error" | tail -3; cp /tmp/uns/trl_methods_results.json $OUT/uns.json
date -u
