#!/usr/bin/env bash
# Session 37, call 1: NF4 -> e4m3 ablations and the table variant; the GLU kernels' GPU tests (after 4dba342);
# where the --fp8 ckpt-off step goes now (p2.py)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 200 python3 .gpu/n1.py 2>&1 | grep -v Warn | tee $OUT/n1.txt
date -u
timeout 200 python3 -m pytest -q -x -m gpu -n 8 tests/test_lora.py tests/test_fp8_gpu.py "tests/test_kernels.py" -k "activation or glu or swiglu or geglu or lora or fp8 or mlp" -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.txt
date -u
TOP=45 timeout 150 python3 .gpu/p2.py fp8:off 2>&1 | grep -v Warn | tee $OUT/prof.txt
date -u
