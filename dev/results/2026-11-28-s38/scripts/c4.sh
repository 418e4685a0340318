#!/usr/bin/env bash
# Session 38, call 4 (H200): Llama-3.1-8B QLoRA 2x2048 ckpt off in one run: nanotune exact (qlora_big), Unsloth
# (qlora_big), nanotune --fp8 (ab2.py, the same setup built in memory)
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whlu/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
timeout 150 python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -2
date -u
STEPS=10 timeout 80 python3 .gpu/ab2.py . fp8:off 2>&1 | grep '^{' | tee -a $OUT/ab.jsonl
date -u
timeout 300 python3 .anchors/qlora_big.py --run /tmp/l8 --cases nanotune:off:2x2048,unsloth:off:2x2048 --out $OUT/qb 2>&1 | grep -v Warn | tail -12
date -u
