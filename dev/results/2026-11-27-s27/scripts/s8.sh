#!/usr/bin/env bash
# Session 27 call 8: --fp8 with fast accumulation beside Unsloth on one machine (Llama-3.1-8B 2x2048): nanotune's graphed
# step (.gpu/ab.py, this tree) off and on + offload, then qlora_big.py's nanotune bf16 off and Unsloth off and on
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for case in fp8:off fp8:on+offload; do
  timeout $(left 75) python3 .gpu/ab.py . $case > /tmp/ab.log 2>&1; grep '^{' /tmp/ab.log | tee -a $OUT/ab.jsonl || tail -3 /tmp/ab.log
done
date -u
timeout $(left 90) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 330) --case-timeout 140 --cases nanotune:off:2x2048,unsloth:off:2x2048,unsloth:on:2x2048 2>&1 | grep -E "^===|status" | tail -6
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
