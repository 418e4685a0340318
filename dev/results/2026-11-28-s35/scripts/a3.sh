#!/usr/bin/env bash
# Session 35, call 6: the GLU kernels with terms as pipelined strips (the tree) against HEAD (.mid): kernel times and
# digests; the GPU tests of the activations and the LoRA MLP; Qwen2.5-0.5B 4x2048 bf16 LoRA steps, alternating
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 60 python3 .gpu/t3.py .mid 2>&1 | grep -v Warn | tee $OUT/t3_old.txt
SWEEP=1 timeout 120 python3 .gpu/t3.py . 2>&1 | grep -v Warn | tee $OUT/t3_new.txt
date -u
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k "lowrank or glu or swiglu or geglu or activation" 2>&1 | tail -2 | tee $OUT/tests_kernels.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mlp or terms or fp8" 2>&1 | tail -2 | tee $OUT/tests_lora.txt
date -u
for ckpt in off on+offload; do for r in 1 2; do
  SHAPE=qwen2.5-0.5b CKPT=$ckpt timeout 60 python3 .gpu/ab3.py .mid 2>&1 | grep '^{' | tee -a $OUT/ab_qwen.jsonl
  SHAPE=qwen2.5-0.5b CKPT=$ckpt timeout 60 python3 .gpu/ab3.py . 2>&1 | grep '^{' | tee -a $OUT/ab_qwen.jsonl
done; done
date -u
