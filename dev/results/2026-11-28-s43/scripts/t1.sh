#!/usr/bin/env bash
# Session 43, the one-run table 1/3 (H200): Llama-3.1-8B 2x2048 nanotune, Unsloth, HF+PEFT; nanotune --fp8; power trace
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 500 > $OUT/smi.csv 2>&1 &
SM=$!
[ -f /tmp/l8/config.json ] || timeout $(left 110) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 420) --case-timeout 150 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048,hf:on:2x2048 2>&1 | while read -r l; do echo "$(date -u +%T) $l"; done | tee $OUT/steps.txt | grep -E "===|status"
date -u +%T
timeout $(left 140) python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --fp8 --out $OUT/fp8.json --time-budget $(left 135) 2>&1 | grep -E "^\| llama"
kill $SM
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
