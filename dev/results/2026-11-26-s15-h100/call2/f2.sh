#!/usr/bin/env bash
# HF (+Liger) full fine-tuning, fp32 masters, SmolLM2 (D) and Qwen2.5-0.5B (B) shapes, 8x512 and 4x2048
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
python3 .anchors/hf_baseline.py --full --master fp32 --configs D,B --batch 8 --seq 512 --out $OUT/hf_8x512 --deadline-s 250 2>&1 | grep -E "^\|" | tail -9
python3 .anchors/hf_baseline.py --full --master fp32 --configs D,B --batch 4 --seq 2048 --out $OUT/hf_4x2048 --deadline-s $(( 580 - SECONDS )) 2>&1 | grep -E "^\|" | tail -9
date -u
