#!/usr/bin/env bash
# Session 36, call 1: h_q kernels (t4.py), then Llama-3.1-8B NF4 2x2048 graphed steps --fp8 and exact bf16, ckpt off,
# and Qwen2.5-0.5B 4x2048 bf16 LoRA off, the tree against HEAD (.mid), alternating
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 80 python3 .gpu/t4.py 2>&1 | grep -v Warn | tee $OUT/t4.txt
date -u
for t in .mid . . .mid; do timeout 80 python3 .gpu/ab2.py $t fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab_llama.jsonl; done
date -u
for t in .mid .; do SHAPE=qwen2.5-0.5b CKPT=off timeout 50 python3 .gpu/ab3.py $t 2>&1 | grep '^{' | tee -a $OUT/ab_qwen.jsonl; done
date -u
for t in . .mid; do timeout 80 python3 .gpu/ab2.py $t bf16:off 2>&1 | grep '^{' | tee -a $OUT/ab_llama.jsonl; done
date -u
