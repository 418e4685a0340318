#!/usr/bin/env bash
# Session 27 call 6: GPU tests of the GLU backward with the adapters' products; its microbenchmark and launch sweep;
# the step A/B (.mid = HEAD with fast accumulation, . = the new kernel): Qwen2.5-7B and Llama-3.1-8B bf16 off, Llama fp8 off
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout 120 python3 -m pytest tests/test_glu_lora_backward.py tests/test_lora.py -q -m gpu -p no:cacheprovider -k "gpu_kernel or cuda_fused" 2>&1 | grep -E "FAILED|passed|failed|Error|assert" | tail -8 | tee $OUT/tests.txt
timeout $(left 100) python3 .gpu/glb.py 2>&1 | tee $OUT/glb.txt
date -u
for sc in qwen2.5-7b:bf16:off llama-3.1-8b:bf16:off llama-3.1-8b:fp8:off; do
  for tree in .mid . ; do
    SHAPE=${sc%%:*} timeout $(left 70) python3 .gpu/ab2.py $tree ${sc#*:} > /tmp/ab.log 2>&1; grep '^{' /tmp/ab.log | tee -a $OUT/ab.jsonl || tail -3 /tmp/ab.log
  done
done
date -u
