#!/usr/bin/env bash
# Unsloth full fine-tuning (float32_mixed_precision), SmolLM2 (D) and Qwen2.5-0.5B (B) shapes, 8x512 and 4x2048
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
python3 .anchors/unsloth_bench.py --full --master fp32 --configs D,B --batch 8 --seq 512 --out $OUT/u_8x512 --deadline-s 240 2>&1 | grep -E "^\|" | tail -5
python3 .anchors/unsloth_bench.py --full --master fp32 --configs D,B --batch 4 --seq 2048 --out $OUT/u_4x2048 --deadline-s $(( 540 - SECONDS )) 2>&1 | grep -E "^\|" | tail -5
date -u
