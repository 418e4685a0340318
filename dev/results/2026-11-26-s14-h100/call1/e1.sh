#!/usr/bin/env bash
# fp8: main vs the tensor-wise-scales patch (GPU tests, bench_nf4, bench_qlora --fp8), then profiles of the fp8 and bf16 steps
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 60) python3 scripts/bench/bench_nf4.py > $OUT/nf4_before.txt 2>&1; grep -E "transposed" $OUT/nf4_before.txt | head -2
timeout $(left 100) python3 scripts/bench/bench_qlora.py --fp8 --shapes llama-3.1-8b --ckpt off --long-shapes none --out $OUT/q_fp8_before.json --time-budget $(left 95) 2>&1 | grep -E "^\|" | tail -1
patch -p1 < dev/patches/fp8-tensorwise-scales.patch > /dev/null && echo patched
timeout $(left 120) python3 -m pytest tests/test_fp8_gpu.py tests/test_fp8.py -q -m gpu 2>&1 | tail -15 > $OUT/tests.txt; tail -2 $OUT/tests.txt
timeout $(left 60) python3 scripts/bench/bench_nf4.py > $OUT/nf4_after.txt 2>&1; grep -E "transposed|tensor" $OUT/nf4_after.txt | head -6
timeout $(left 160) python3 scripts/bench/bench_qlora.py --fp8 --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_fp8_after.json --time-budget $(left 155) 2>&1 | grep -E "^\|" | tail -2
cp .gpu/prof_fp8.py scripts/prof_fp8.py
timeout $(left 90) python3 scripts/prof_fp8.py fp8 > $OUT/prof_fp8.txt 2>&1; tail -3 $OUT/prof_fp8.txt
timeout $(left 90) python3 scripts/prof_fp8.py bf16 > $OUT/prof_bf16.txt 2>&1; tail -3 $OUT/prof_bf16.txt
date -u
