#!/usr/bin/env bash
# Session 20, call 1: the whole GPU suite on today's tree (bitsandbytes, datasets, trl carried); where a rollout's
# GPU time goes per kernel on the five-launch path (gaps2.py, both shapes).
set -uo pipefail
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 330) python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -12 > $OUT/tests.txt; cat $OUT/tests.txt
for s in qwen2.5-0.5b smollm2-135m; do timeout $(left 90) python3 .gpu/gaps2.py --shape $s --tokenizer $R/.gpu/tok 2>&1 | grep -v "Writing model" | tee -a $OUT/gaps2.txt; done
date -u
