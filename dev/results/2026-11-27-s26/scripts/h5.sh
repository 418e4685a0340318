#!/usr/bin/env bash
# Session 26 call 5: the NF4 kernels' change (transposed store fixed), step A/B on one machine (.base = HEAD a5df4fa)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 scripts/bench/bench_nf4.py 2>&1 | tail -30 | tee $OUT/bench_nf4.txt
for case in fp8:off bf16:off fp8:on+offload bf16:on+offload; do
  for tree in .base .; do
    timeout 80 python3 .gpu/ab.py $tree $case > $OUT/ab_$(echo $tree$case | tr -d ':.+/').log 2>&1
    grep '^{' $OUT/ab_$(echo $tree$case | tr -d ':.+/').log | tee -a $OUT/ab.jsonl
  done
done
date -u
timeout 170 python3 -m pytest tests/test_nf4.py tests/test_fp8_gpu.py tests/test_fp8_kernels.py tests/test_qlora.py tests/test_fp8.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
date -u
