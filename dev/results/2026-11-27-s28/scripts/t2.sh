#!/usr/bin/env bash
# Session 28 call 2: the one-read LoRA dY products at the tree's launch configuration: GPU tests, microbench, steps against .mid
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_qlora.py tests/test_lora.py -k "adapter_grads or qlora or lora" 2>&1 | tail -4 | tee $OUT/tests.txt
timeout 100 python3 .gpu/ag.py 2>&1 | tee $OUT/ag.txt
for i in 1 2 3; do for t in .mid .; do SHAPE=qwen2.5-7b STEPS=10 timeout 60 python3 .gpu/ab2.py $t bf16:off 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done; done
for i in 1 2; do for t in .mid .; do SHAPE=llama-3.1-8b STEPS=10 timeout 60 python3 .gpu/ab2.py $t bf16:off 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done; done
date -u
