#!/usr/bin/env bash
# Session 33, call 1: z1.py (Gemma 2/3 rollouts, fused_decode off and default) in .mid (deff65f: the model's layers
# for sandwich norms) and the tree (decode_layers with the sandwich add_rms_norm), alternating twice; then the
# add_rms_norm kernel tests and the GPU generation/rollout tests
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
root=$PWD
for r in 1 2; do
  (cd .mid && python3 $root/.gpu/z1.py old$r $OUT/old$r.json 2>&1 | tail -12)
  python3 .gpu/z1.py new$r $OUT/new$r.json 2>&1 | tail -12
done | tee $OUT/ab.txt
date -u
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py -k add_rms_norm 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
