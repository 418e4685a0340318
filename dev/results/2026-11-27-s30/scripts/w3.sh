#!/usr/bin/env bash
# Session 30: step A/B of the adapters inside the activation (.mid = HEAD 65daad5 against the tree), trees alternating
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
for i in 1 2; do for t in .mid .; do
  SHAPE=tinyllama CKPT=off python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
  SHAPE=qwen2.5-0.5b CKPT=off python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
  SHAPE=smollm2-135m CKPT=off python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
  SHAPE=tinyllama CKPT=on+offload python3 .gpu/ab3.py $t 2>/dev/null | tee -a $OUT/ab.jsonl
done; done
for i in 1 2; do for t in .mid .; do
  SHAPE=llama-3.1-8b STEPS=8 python3 .gpu/ab2.py $t fp8:off 2>/dev/null | tee -a $OUT/ab.jsonl
done; done
date -u
