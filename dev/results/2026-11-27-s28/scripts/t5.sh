#!/usr/bin/env bash
# Session 28 call 5: the one read on the unfolded MLP path: GPU tests; small-model rows and --fp8, .mid against the tree
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 -m pytest -q -m gpu tests/test_qlora.py tests/test_lora.py tests/test_fp8_gpu.py tests/test_kernels.py -k "folded or lora or fp8 or adapter_grads" 2>&1 | tail -3 | tee $OUT/tests.txt
for i in 1 2; do for t in .mid .; do SHAPE=qwen2.5-0.5b timeout $(left 60) python3 .gpu/ab3.py $t 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done; done
for t in .mid .; do SHAPE=tinyllama timeout $(left 60) python3 .gpu/ab3.py $t 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
for t in .mid .; do SHAPE=smollm2-135m timeout $(left 60) python3 .gpu/ab3.py $t 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
for t in .mid .; do SHAPE=llama-3.1-8b STEPS=10 timeout $(left 80) python3 .gpu/ab2.py $t fp8:off 2>&1 | tail -1 | tee -a $OUT/ab.jsonl; done
date -u
