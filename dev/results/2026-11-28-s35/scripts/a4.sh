#!/usr/bin/env bash
# Session 35, call 7: three stages (the tree) against HEAD (.mid): Llama-3.1-8B NF4 --fp8 2x2048 steps (ckpt off,
# on+offload) and Qwen2.5-0.5B 4x2048 bf16 LoRA (off), alternating; kernel times; test_lora's MLP tests in both trees
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 40 python3 .gpu/t3.py . 2>&1 | grep -v Warn | tee $OUT/t3_new.txt
for t in .mid . . .mid; do timeout 90 python3 .gpu/ab2.py $t fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab_llama.jsonl; done
for t in .mid .; do timeout 90 python3 .gpu/ab2.py $t fp8:on+offload 2>&1 | grep '^{' | tee -a $OUT/ab_llama.jsonl; done
for t in .mid .; do SHAPE=qwen2.5-0.5b CKPT=off timeout 60 python3 .gpu/ab3.py $t 2>&1 | grep '^{' | tee -a $OUT/ab_qwen.jsonl; done
date -u
(cd .mid && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mlp or terms or fp8" 2>&1 | tail -1) | tee $OUT/lora_old.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mlp or terms or fp8" 2>&1 | tail -1 | tee $OUT/lora_new.txt
date -u
