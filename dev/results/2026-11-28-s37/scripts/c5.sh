#!/usr/bin/env bash
# Session 37, call 5: nf4_to_fp8 along K first (.) against HEAD (.mid) on one machine: bench_nf4.py and the fp8
# ckpt-off step's kernels (p2.py), alternating; then the GPU tests that ran out of memory under 8 workers, serially
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
ROOT=$(pwd)
for t in .mid . .mid .; do (cd $t && timeout 100 python3 scripts/bench/bench_nf4.py 2>&1 | grep -v Warn | sed "s|^|$t |" >> $OUT/bench_nf4.txt); done
grep 'llama-3.1-8b | \(q|k|v\|gate|up\|down\) | 0.0' $OUT/bench_nf4.txt
date -u
for t in .mid .; do (cd $t && TOP=6 timeout 100 python3 $ROOT/.gpu/p2.py fp8:off 2>&1 | grep 'a step\|nf4_to_fp8' | sed "s|^|$t |" | tee -a $OUT/prof.txt); done
date -u
timeout -s INT 300 python3 -m pytest -q -rfE -p no:cacheprovider -W ignore $(cat .gpu/failed_ids.txt) > $OUT/gpu_tests_serial.txt 2>&1
tail -8 $OUT/gpu_tests_serial.txt
date -u
