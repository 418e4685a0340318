#!/usr/bin/env bash
# Session 37, call 3: nf4_to_fp8 with the grid along K first (this tree) against HEAD (.mid): kernel totals under
# the profiler and graphed step times, Llama-3.1-8B NF4 --fp8 2x2048 ckpt off; the op/shape attribution (p5.py);
# the fp8 GPU tests
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 120 python3 -m pytest -q -m gpu tests/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/tests.txt
for t in .mid .; do (cd $t && TOP=14 timeout 100 python3 ../.gpu/p2.py fp8:off 2>&1 | grep -v Warn | sed "s|^|$t |" | tee -a $OUT/prof.txt); done
date -u
for t in . .mid . .mid; do timeout 80 python3 .gpu/ab2.py $t fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl; done
date -u
TOP=60 timeout 100 python3 .gpu/p5.py fp8 2>&1 | grep -v Warn | tee $OUT/p5.txt
date -u
