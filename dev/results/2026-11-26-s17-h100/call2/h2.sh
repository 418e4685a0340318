#!/usr/bin/env bash
# Session 17, call 2: prefill branch (.wtp) GPU tests; GRPO rollouts main / merge (.wtm) / prefill (.wtp), both shapes;
# rollout_parts on the three; the Llama-3.1-8B NF4 step's top kernels (bf16, ckpt off) on main.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
(cd .wtp && timeout $(left 120) python3 -m pytest tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests_prefill.txt); tail -5 $OUT/tests_prefill.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for s in qwen2.5-0.5b smollm2-135m; do for t in . .wtm .wtp; do (cd $t && timeout $(left 50) $G --shape $s --out $OUT/grpo_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | cut -c1-170 | sed "s/^/$t /"); done; done
for t in .wtp .wtm .; do (cd $t && timeout $(left 50) python3 $OLDPWD/.gpu/rollout_parts.py --shape qwen2.5-0.5b --tokenizer $OLDPWD/.gpu/tok 2>&1 | grep -v Warn | sed "s/^/$t /" | tee -a $OUT/parts.txt); done
timeout $(left 150) python3 .gpu/prof_fp8.py bf16 > $OUT/prof_8b_off.txt 2>&1; head -40 $OUT/prof_8b_off.txt | cut -c1-200
date -u
