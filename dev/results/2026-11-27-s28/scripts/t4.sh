#!/usr/bin/env bash
# Session 28 call 4: ckpt on + offload before/after (Qwen2.5-7B, Llama-3.1-8B), then the model-level GPU tests
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for i in 1 2; do for t in .mid .; do SHAPE=qwen2.5-7b STEPS=10 timeout $(left 70) python3 .gpu/ab2.py $t bf16:on+offload 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done; done
for t in .mid .; do SHAPE=llama-3.1-8b STEPS=10 timeout $(left 70) python3 .gpu/ab2.py $t bf16:on+offload 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
date -u
timeout $(left 240) python3 -m pytest -q -m gpu tests/test_gpu_model.py tests/test_step.py tests/test_offload.py tests/test_lora.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
