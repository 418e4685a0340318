#!/usr/bin/env bash
# Session 40, call 6 (H200): DoRA with dropout's adapter term (_LowRank) on the GPU against float64, and plain
# autograd's at the same shapes (the layout it replaces)
set -uo pipefail; export PYTHONUNBUFFERED=1
date -u; mkdir -p $OUT
timeout 120 python3 -m pytest -q -m gpu tests/test_variants.py -p no:cacheprovider 2>&1 | tail -3
timeout 60 python3 .gpu/lr.py 2>&1 | tail -12
date -u
