#!/usr/bin/env bash
# Session 43, the one-run table 3/3 (H200): Gemma-2-9B (nanotune), Qwen2.5-7B 2x2048 nanotune and Unsloth, nanotune --fp8 ckpt off
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
rm -rf /tmp/l8
timeout $(left 150) python3 scripts/bench/bench_qlora.py --shapes gemma-2-9b --ckpt off,on+offload --long-shapes none --out $OUT/gemma.json --time-budget $(left 145) 2>&1 | grep -E "^\| gemma"
timeout $(left 70) python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q --deadline $(left 480) --case-timeout 120 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 2>&1 | grep -E "^===|status"
timeout $(left 100) python3 scripts/bench/bench_qlora.py --shapes qwen2.5-7b --ckpt off --long-shapes none --fp8 --out $OUT/qfp8.json --time-budget $(left 95) 2>&1 | grep -E "^\| qwen"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
