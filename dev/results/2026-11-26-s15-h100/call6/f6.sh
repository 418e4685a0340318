#!/usr/bin/env bash
# Gemma-2-9B QLoRA 2x2048 (exact softcaps): nanotune and Unsloth, ckpt off and on(+offload), same machine
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
timeout 200 python3 scripts/bench/bench_qlora.py --shapes gemma-2-9b --write-checkpoint /tmp/g9 2>&1 | grep -v "Writing\|Loading" | tail -3; du -sh /tmp/g9; date -u
python3 .anchors/qlora_big.py --run /tmp/g9 --out $OUT/q --deadline $(( 560 - SECONDS )) --case-timeout 170 --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 2>&1 | grep -E "^===|status"
grep -iE "softcap|warn|attn|attention" $OUT/q/cases.log | sort | uniq -c | sort -rn | head -20
date -u
