#!/usr/bin/env bash
# Session 30: the activation with the adapters' terms: kernel sweep, GPU tests, then step A/B (.mid = HEAD 65daad5)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
python3 .gpu/glub.py 2>&1 | grep -v Warn | tee $OUT/glub.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "activation or lowrank" 2>&1 | tail -2
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora.py -k "cuda_fused" 2>&1 | tail -2
for i in 1 2; do for t in .mid .; do
  SHAPE=tinyllama CKPT=off python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
  SHAPE=qwen2.5-0.5b CKPT=off python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
done; done
date -u
