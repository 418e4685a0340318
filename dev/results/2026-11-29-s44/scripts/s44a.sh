#!/usr/bin/env bash
# Session 44, call A (H200): Gemma-3-12B QLoRA 2x2048 (a written random checkpoint): nanotune and Unsloth, ckpt off then on
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
git rev-parse --short HEAD; git status --short | head
[ -f /tmp/g12/config.json ] || { /usr/bin/time -f "write %e s" timeout $(left 240) python3 scripts/bench/bench_qlora.py --shapes gemma-3-12b --write-checkpoint /tmp/g12 2>&1 | grep -v Writing | tail -2; }
du -sh /tmp/g12; date -u +%T
python3 .anchors/qlora_big.py --run /tmp/g12 --out $OUT/q --deadline $(left 575) --case-timeout 200 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 2>&1 | while read -r l; do echo "$(date -u +%T) $l"; done | tee $OUT/steps.txt | grep -E "===|status"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'), r.get('build_s'), (r.get('error') or '')[:300])" 2>&1 | tee $OUT/summary.txt
tail -c 3000 $OUT/q/cases.log | grep -v "^\s*$" | tail -25
date -u
