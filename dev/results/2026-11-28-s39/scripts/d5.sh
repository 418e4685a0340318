#!/usr/bin/env bash
set -uo pipefail; export PYTHONUNBUFFERED=1; mkdir -p $OUT; date -u
timeout 400 python3 .gpu/m4.py 2>&1 | tee $OUT/m4.txt | tail -40
date -u
