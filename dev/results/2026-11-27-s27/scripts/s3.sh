#!/usr/bin/env bash
# Session 27 call 3: --fp8's 200-step loss curve beside bf16 (SmolLM2-135M-Instruct GGUF, built-in data) with fast accumulation
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
if [ -f /tmp/gguf_p1 ]; then cat /tmp/gguf_p1 .gg2/p2 > /tmp/smollm2.gguf; sha1sum /tmp/smollm2.gguf
  timeout 560 python3 scripts/bench/fp8_curve.py --model /tmp/smollm2.gguf --steps 200 --out $OUT/fp8_curve.jsonl > $OUT/fp8.log 2>&1; tail -2 $OUT/fp8.log
else echo "no gguf half on this machine"; fi
date -u
