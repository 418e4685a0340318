#!/usr/bin/env bash
# Session 21, call 9: gate | up in place (gu.py): the SwiGLU GEMM's variants inside a Qwen2.5-0.5B rollout.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout 190 python3 .gpu/gu.py --tokenizer $R/.gpu/tok 2>&1 | grep -E "rollout|Error|error" | tee $OUT/gu.txt
date -u
