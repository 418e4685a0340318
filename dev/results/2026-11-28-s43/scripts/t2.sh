#!/usr/bin/env bash
# Session 43, the one-run table 2/3 (H200): Llama-3.1-8B long rows, nanotune and Unsloth
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
[ -f /tmp/l8/config.json ] || timeout $(left 110) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 575) --case-timeout 200 --cases nanotune:on+offload:1x32768:1:2,unsloth:on:1x32768:1:2,nanotune:on+offload:1x65536:1:1,unsloth:on:1x65536:1:1,nanotune:on+offload:1x131072:0:1,unsloth:on:1x131072:0:1 2>&1 | grep -E "^===|status"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
