#!/usr/bin/env bash
# Session 33, call 6: z6.py (Qwen3-4B, Gemma-3-1B, Gemma-2-2B rollouts on the nine-launch layers) in .mid3 (40ce2dc)
# and the tree (rope_into_cache and add_rms_norm as dependent launches), alternating twice; then the decoding kernels'
# tests on the GPU and the GPU tests of the decoding GEMMs, generation, rollouts, sampling and RL
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
root=$PWD
for r in 1 2; do
  (cd .mid3 && python3 $root/.gpu/z6.py old$r $OUT/old$r.json 2>&1 | tail -6)
  python3 .gpu/z6.py new$r $OUT/new$r.json 2>&1 | tail -6
done | tee $OUT/ab.txt
date -u
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py -rf --tb=line 2>&1 | tail -4 | tee $OUT/kt.txt
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py tests/test_sample.py tests/test_rl_gpu.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
