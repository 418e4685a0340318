#!/usr/bin/env bash
# Session 26 call 6: GPU tests of the changed kernels and fp8 path; the amax fusion A/B (.mid = HEAD + the NF4 kernels,
# . = this tree); then Unsloth's Llama-3.1-8B 2x2048 steps on the same machine, as time allows
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout 200 python3 -m pytest tests/test_fp8_gpu.py tests/test_fp8_kernels.py tests/test_nf4.py tests/test_qlora.py tests/test_fp8.py tests/test_kernels.py tests/test_lora.py -q -m gpu -p no:cacheprovider -x 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
for case in fp8:off fp8:on+offload; do
  for tree in .mid .; do
    timeout $(left 80) python3 .gpu/ab.py $tree $case > $OUT/ab_$(echo $tree$case | tr -d ':.+/').log 2>&1
    grep '^{' $OUT/ab_$(echo $tree$case | tr -d ':.+/').log | tee -a $OUT/ab.jsonl
  done
done
date -u
[ -f /tmp/l8/config.json ] || timeout $(left 110) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 300) --case-timeout 140 --cases unsloth:on:2x2048,unsloth:off:2x2048 2>&1 | grep -E "^===|status"
python3 -c "
import json
for r in json.load(open('$OUT/q/results.json')): print(r['case'], r['status'], r.get('step_ms'), r.get('tokens_per_s'), r.get('peak_gib'))" 2>&1 | tee $OUT/summary.txt
date -u
