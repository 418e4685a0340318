#!/usr/bin/env bash
# diagnostics: cuDNN SDPA backward from a saved (out, lse); the small-model rows (no-regression); DoRA and LoRA profiles after dora5
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT; cp .gg1/p1 /tmp/gguf_p1
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 100) python3 .gpu/cudnn_bias.py > $OUT/cudnn_bias.txt 2>&1; cat $OUT/cudnn_bias.txt | grep -v Warn | tail -12
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --step-opts cuda_graphs=on"
timeout $(left 60) $B --shapes smollm2-135m --ckpt off --time-budget $(left 55) --out $OUT/small_smol.json 2>&1 | grep -E "^\| smol"
timeout $(left 250) $B --shapes tinyllama,qwen2.5-0.5b --ckpt off,on+offload --time-budget $(left 240) --out $OUT/small.json 2>&1 | grep -E "^\| (tiny|qwen)"
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12"
timeout $(left 50) python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --dora --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pd > $OUT/prof_dora.txt 2>&1; grep -E "Self CUDA time|_dora" $OUT/prof_dora.txt | cut -c1-60,150-260
timeout $(left 45) python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pl > $OUT/prof_lora.txt 2>&1; grep -E "Self CUDA time" $OUT/prof_lora.txt
date -u
