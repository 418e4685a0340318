#!/usr/bin/env bash
# Session 24, call 8: GPU tests of the final kept-attention tree; then Llama-3.1-8B QLoRA beside Unsloth
# (qlora_big.py): 2x2048 on(+offload), 1x65536, then nanotune's 1x131072 as the deadline allows
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 590 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout 130 python3 -m pytest tests/test_offload.py tests/test_step.py tests/test_gpu_model.py -q -m gpu -p no:cacheprovider -x 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -6 | tee $OUT/tests.txt
[ -f /tmp/l8/config.json ] || timeout $(left 130) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 580) --case-timeout 150 --cases nanotune:on+offload:2x2048,unsloth:on:2x2048,nanotune:on+offload:1x65536:1:1,unsloth:on:1x65536:1:1,nanotune:on+offload:1x131072:0:1 2>&1 | grep -E "^===|status"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
