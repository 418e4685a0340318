#!/usr/bin/env bash
# Session 28 call 3: Qwen2.5-7B exact bf16 ckpt off beside Unsloth (qlora_big.py, this tree), then GPU tests
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 100) python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q --deadline $(left 330) --case-timeout 140 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:off:2x2048 2>&1 | grep -E "^===|status" | tail -6
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
timeout $(left 150) python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_qlora.py tests/test_step.py -k "adapter_grads or folded or graph" 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
