#!/usr/bin/env bash
# Session 27 call 4: fp8 GPU tests with fast accumulation; the fp8 A/B (.mid = 0c34b8c, . = fast accumulation);
# Qwen2.5-7B 2x2048 ckpt off, nanotune then Unsloth (qlora_big.py, same machine); Unsloth's Llama off as time allows
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout 150 python3 -m pytest tests/test_fp8_gpu.py tests/test_fp8_kernels.py tests/test_fp8.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|assert" | tail -8 | tee $OUT/tests.txt
date -u
for case in fp8:off fp8:on+offload; do
  for tree in .mid . ; do
    timeout $(left 75) python3 .gpu/ab.py $tree $case > /tmp/ab.log 2>&1; grep '^{' /tmp/ab.log | tee -a $OUT/ab.jsonl
  done
done
date -u
timeout $(left 90) python3 .anchors/qlora_big.py --prepare /tmp/q7 --arch qwen2 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/q7 --out $OUT/q --deadline $(left 200) --case-timeout 110 --cases nanotune:off:2x2048,unsloth:off:2x2048 2>&1 | grep -E "^===|status" | tail -4
date -u
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
