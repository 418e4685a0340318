#!/usr/bin/env bash
# Session 20, call 5 (the machine of call 4): bench_grpo Qwen on .old20 and this tree once more (call 4's first
# .old20 run ran out of its time); GRPO in TRL + PEFT (configs D, B: SmolLM2-135M and Qwen2.5-0.5B shapes); nanotune's
# bench_grpo on the same two models.
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
G="python3 scripts/bench/bench_grpo.py --tokenizer $R/.gpu/tok --ignore-eos --cache-dir /tmp/bc"
for t in .old20 .; do (cd $t && timeout $(left 60) $G --shape qwen2.5-0.5b --out $OUT/grpo3_qwen2.5-0.5b_$(basename $(realpath .)).json 2>&1 | grep -E "^GRPO" | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330 | sed "s/^/3 $t /"); done
python3 .anchors/trl_methods.py --methods grpo --systems trl --configs D,B --tokenizer .anchors/tok --out /tmp/trl --deadline-s $(left 300) 2>&1 | grep -E "^\| (SmolLM2|Qwen)" | tail -4; cp /tmp/trl/trl_methods_results.json $OUT/trl.json
M=/tmp/trl_methods_models; ls $M
for c in D B; do timeout $(left 60) python3 scripts/bench/bench_grpo.py --model $M/m_$c --tokenizer .anchors/tok --ignore-eos --out $OUT/nt_grpo_$c.json 2>&1 | grep -E "^GRPO" | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330; done
date -u
