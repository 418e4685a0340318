#!/usr/bin/env bash
# offload GPU tests (registered pinned buffers); Llama-3.1-8B QLoRA one step at the predicted longest length 377856
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
timeout 90 python3 -m pytest tests/test_offload.py tests/test_step.py -q -m gpu -k "offload" 2>&1 | tail -3 > $OUT/tests.txt; tail -1 $OUT/tests.txt
(while true; do free -m | awk 'NR==2{print $3}' >> /tmp/host_used.txt; sleep 5; done) &
timeout $(( 585 - SECONDS )) python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long none --longest 377856 --out $OUT/l378.json --time-budget $(( 580 - SECONDS )) > $OUT/l378.txt 2>&1; tail -1 $OUT/l378.txt
sort -n /tmp/host_used.txt | tail -1; cp /tmp/host_used.txt $OUT/
date -u
