#!/usr/bin/env bash
# Session 39, call 1: the README's CPU test command on a GPU machine (all but the compile checks), to name what fails there
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; mkdir -p $OUT
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)"
timeout -s INT 540 python3 -m pytest -q -rfE -p no:cacheprovider -n 16 --dist loadgroup -m "not gpu" -W ignore \
  --ignore tests/test_kernels_compile.py --durations=40 tests > $OUT/not_gpu.txt 2>&1
grep -E "^(FAILED|ERROR)" $OUT/not_gpu.txt | head -80
tail -45 $OUT/not_gpu.txt
date -u
