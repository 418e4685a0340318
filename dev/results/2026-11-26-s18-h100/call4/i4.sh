#!/usr/bin/env bash
# Qwen2.5-7B QLoRA 2x2048: fold (.), Unsloth, and main (.old6), checkpointing off and on(+offload), one machine (qlora_big.py)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
[ -f /tmp/q7/config.json ] || timeout $(left 150) python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q --deadline $(left 330) --case-timeout 150 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 2>&1 | grep -E "^===|status"
(cd .old6 && python3 ../.anchors/qlora_big.py --run /tmp/q7 --out $OUT/q_main --deadline $(left 150) --case-timeout 100 --cases nanotune:off:2x2048,nanotune:on+offload:2x2048 2>&1 | grep -E "^===|status")
python3 -c "
import json
for f in ('$OUT/q/results.json', '$OUT/q_main/results.json'):
    for r in json.load(open(f)): print(f.split('/')[-2], r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))"
date -u
