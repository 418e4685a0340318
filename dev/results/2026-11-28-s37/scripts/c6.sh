#!/usr/bin/env bash
# Session 37, call 6: the GPU tests that ran out of memory under 8 workers (call 4), serially
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
date -u; mkdir -p $OUT
timeout -s INT 400 python3 -c "
import sys, pytest
ids = [l.strip() for l in open('.gpu/failed_ids.txt') if l.strip()]
sys.exit(pytest.main(['-q', '-rfE', '-m', 'gpu', '-p', 'no:cacheprovider', '-W', 'ignore', *ids]))
" > $OUT/gpu_tests_serial.txt 2>&1
tail -8 $OUT/gpu_tests_serial.txt
date -u
