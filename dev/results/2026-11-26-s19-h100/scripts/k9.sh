#!/usr/bin/env bash
# Session 19, call 9: test_rl_gpu on this tree and on .old19 (a capture failure in call 7); bench_grpo Qwen old/new.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for t in . .old19; do (cd $t && timeout $(left 120) python3 -m pytest tests/test_rl_gpu.py -q -m gpu -p no:cacheprovider -k graphed_grpo_update 2>&1 | grep -E "FAILED|passed|failed|rror" | tail -6 | sed "s|^|$t |" | tee -a $OUT/tests_rl.txt); done
G="python3 scripts/bench/bench_grpo.py --tokenizer $PWD/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for r in 1 2; do for t in .old19 .; do (cd $t && timeout $(left 100) $G --shape qwen2.5-0.5b --out $OUT/grpo${r}_qwen2.5-0.5b_$(basename $(realpath .)).json 2>&1 | grep -v Warn | tail -2 | cut -c1-240 | sed "s/^/$r $t /"); done; done
date -u
