#!/usr/bin/env bash
# Session 28 call 1: one-read LoRA dY products: GPU tests, microbench sweep, Qwen2.5-7B / Llama-3.1-8B steps against .mid
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 100 python3 -m pytest -q -m gpu tests/test_kernels.py -k adapter_grads tests/test_qlora.py 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 150 python3 .gpu/ag.py 2>&1 | tee $OUT/ag.txt
for t in .mid . .mid .; do SHAPE=qwen2.5-7b timeout 100 python3 .gpu/ab2.py $t bf16:off 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
for t in .mid .; do SHAPE=llama-3.1-8b timeout 100 python3 .gpu/ab2.py $t bf16:off 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
date -u
