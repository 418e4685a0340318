#!/usr/bin/env bash
# Llama-3.1-8B QLoRA DPO row (nanotune); then Llama-3.1-8B QLoRA 2x2048 nanotune and Unsloth, ckpt off, same machine
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 455 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 90) python3 .anchors/qlora_big.py --prepare /tmp/l8 2>&1 | tail -1
timeout $(left 200) python3 scripts/bench/bench_dpo.py --model /tmp/l8 --tokenizer .anchors/tok --out $OUT/dpo_l8.json --steps 6 --warmup 2 -- --quantize nf4 --gradient-checkpointing > $OUT/dpo_l8.txt 2>&1; tail -4 $OUT/dpo_l8.txt
python3 .anchors/qlora_big.py --run /tmp/l8 --out $OUT/q --deadline $(left 300) --cases nanotune:off:2x2048,unsloth:off:2x2048,nanotune:on+offload:2x2048,unsloth:on:2x2048 2>&1 | grep -E "^===|status" 
date -u
