#!/usr/bin/env bash
# Session 44, call B (H200): Gemma-3-12B QLoRA 2x2048: the cases call A left ($1), HF + PEFT ckpt on, nanotune --fp8 (in memory)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
[ -f /tmp/g12/config.json ] || { /usr/bin/time -f "write %e s" timeout $(left 240) python3 scripts/bench/bench_qlora.py --shapes gemma-3-12b --write-checkpoint /tmp/g12 2>&1 | grep -v Writing | tail -2; }
python3 .anchors/qlora_big.py --run /tmp/g12 --out $OUT/q --deadline $(left 420) --case-timeout 220 --cases $1 2>&1 | while read -r l; do echo "$(date -u +%T) $l"; done | tee $OUT/steps.txt | grep -E "===|status"
timeout $(left 160) python3 scripts/bench/bench_qlora.py --shapes gemma-3-12b --ckpt off,on+offload --long-shapes none --fp8 --out $OUT/fp8.json --time-budget $(left 155) 2>&1 | grep -E "^\| gemma"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'), r.get('build_s'), (r.get('error') or '')[:300])" 2>&1 | tee $OUT/summary.txt
date -u
