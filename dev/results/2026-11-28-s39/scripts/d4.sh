#!/usr/bin/env bash
set -uo pipefail; export PYTHONUNBUFFERED=1; mkdir -p $OUT; date -u
timeout 300 python3 .gpu/m3.py 2>&1 | tee $OUT/m3.txt | grep -v "^K 409[67] .*[0-9] $" | tail -80
date -u
