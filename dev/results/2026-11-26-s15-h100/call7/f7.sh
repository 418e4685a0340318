#!/usr/bin/env bash
# --full with q|k|v as one GEMM each way: GPU tests (graphs = eager), Qwen2.5-0.5B 4x2048 beside HF (same call), profile
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 400 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
for s in qwen2.5-0.5b smollm2-135m; do timeout 60 python3 scripts/bench/bench.py --make-checkpoint $s --cache-dir /tmp/bc > /dev/null 2>&1; done; ls /tmp/bc
timeout $(left 110) python3 -m pytest tests/test_train.py tests/test_full.py -q -m gpu -k "variants or resume" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -12 > $OUT/tests.txt; tail -3 $OUT/tests.txt
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12 --full"
for sbt in "qwen2.5-0.5b 4 2048" "qwen2.5-0.5b 8 512" "smollm2-135m 4 2048"; do set -- $sbt; o=/tmp/full_$1_$2x$3
  timeout $(left 45) python3 train.py --model /tmp/bc/$1 $C --batch-size $2 --max-len $3 --out-dir $o > $o.log 2>&1; python3 .gpu/fsum.py $o; cat $o.log >> $OUT/full_logs.txt; done
timeout $(left 100) python3 .anchors/hf_baseline.py --full --master fp32 --configs B --batch 4 --seq 2048 --no-liger --out $OUT/hf_B_4x2048 --deadline-s 90 2>&1 | grep -E "^\| B" | tail -2
timeout $(left 60) python3 .gpu/prof_run.py 5 5 --model /tmp/bc/qwen2.5-0.5b $C --batch-size 4 --max-len 2048 --out-dir /tmp/pf > $OUT/prof_full_4x2048.txt 2>&1; grep -E "Self CUDA time|CUDAFunctor_add<c10::BFlo|cat|Concat" $OUT/prof_full_4x2048.txt | cut -c1-60,150-260 | head -6
date -u
