#!/usr/bin/env bash
# Session 37, call 4: this tree (nf4_to_fp8 along K first): the fp8 ckpt-off step's kernels (p2.py, the same mode
# as call 3's .mid run), bench_nf4.py, then the whole GPU test suite (-m gpu, 8 workers)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
TOP=14 timeout 100 python3 .gpu/p2.py fp8:off 2>&1 | grep -v Warn | tee $OUT/prof.txt
date -u
timeout 150 python3 scripts/bench/bench_nf4.py --out $OUT/bench_nf4.json 2>&1 | grep -v Warn | tee $OUT/bench_nf4.txt
date -u
python3 -c "import xdist" 2>/dev/null && X="-n 8" || X=""
timeout -s INT 320 python3 -m pytest -q -rfE -p no:cacheprovider $X -m gpu -W ignore tests > $OUT/gpu_tests.txt 2>&1
tail -30 $OUT/gpu_tests.txt
date -u
