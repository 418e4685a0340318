#!/usr/bin/env bash
# Session 28 call 6: Llama-3.1-8B exact bf16 ckpt off beside Unsloth (qlora_big.py, this tree)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 330 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 60) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 300) --case-timeout 130 --cases nanotune:off:2x2048,unsloth:off:2x2048 2>&1 | grep -E "^===|status" | tail -4
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
