#!/usr/bin/env bash
# Llama-3.1-8B QLoRA: one step at 262144 tokens, then at 327680 (batch 1, ckpt + offload); host memory watched
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; free -g | head -2
mkdir -p $OUT
(while true; do free -m | awk 'NR==2{print $3}' >> /tmp/host_used.txt; sleep 5; done) &
timeout 260 python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long none --longest 262144 --out $OUT/l262.json --time-budget 255 > $OUT/l262.txt 2>&1; tail -1 $OUT/l262.txt
sort -n /tmp/host_used.txt | tail -1
timeout $(( 585 - SECONDS )) python3 scripts/bench/bench_qlora.py --shapes none --long-shapes llama-3.1-8b --long none --longest 327680 --out $OUT/l327.json --time-budget $(( 580 - SECONDS )) > $OUT/l327.txt 2>&1; tail -1 $OUT/l327.txt
sort -n /tmp/host_used.txt | tail -1; cp /tmp/host_used.txt $OUT/
date -u
