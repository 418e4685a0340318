#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
mkdir -p $OUT; date -u; ls /tmp/bc 2>&1 | head
timeout 60 python3 scripts/bench/bench.py --make-checkpoint smollm2-135m --cache-dir /tmp/bc 2>&1 | tail -5; echo rc $?; date -u; ls /tmp/bc
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12"
timeout 100 python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --dora --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pd > $OUT/prof_dora.txt 2>&1; echo rc $?; grep -E "^step (6|9)/|Self CUDA time|profiled" $OUT/prof_dora.txt; tail -3 $OUT/prof_dora.txt
date -u
