#!/usr/bin/env bash
# Session 17, call 1: branch `merge` (.wtm) on the GPU: its tests; GRPO rollouts main vs merge (both shapes);
# where a rollout's wall time goes (rollout_parts.py) on both trees; DoRA on both.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
(cd .wtm && timeout $(left 170) python3 -m pytest tests/test_kernels.py tests/test_lora.py tests/test_variants.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests_merge.txt); tail -5 $OUT/tests_merge.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for s in qwen2.5-0.5b smollm2-135m; do for t in . .wtm; do (cd $t && timeout $(left 60) $G --shape $s --out $OUT/grpo_${s}_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | sed "s/^/$t /"); done; done
for t in . .wtm; do (cd $t && timeout $(left 60) python3 $OLDPWD/.gpu/rollout_parts.py --shape qwen2.5-0.5b --tokenizer $OLDPWD/.gpu/tok 2>&1 | grep -v Warn | sed "s/^/$t /" | tee -a $OUT/parts.txt); done
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512"
for t in . .wtm; do (cd $t && timeout $(left 45) $B --time-budget $(left 40) --out /tmp/d.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol" | head -1 | sed "s/^/$t dora /"); done
date -u
