#!/usr/bin/env bash
# Session 44, call E (H200): the whole GPU suite on the final tree (-m gpu, two workers)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT; git rev-parse --short HEAD
timeout 560 python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider tests 2>&1 | tee $OUT/gpu_suite.txt | grep -v "^\.\|^$" | tail -15
date -u
