#!/usr/bin/env bash
# profiles: full fine-tuning Qwen2.5-0.5B shape 4x2048 (no ckpt); DoRA and LoRA SmolLM2 shape 8x512 (ckpt)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
for s in qwen2.5-0.5b smollm2-135m; do timeout 60 python3 scripts/bench/bench.py --make-checkpoint $s --cache-dir /tmp/bc --json-out /tmp/mk_$s.json; cat /tmp/mk_$s.json; done
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12"
timeout 100 python3 .gpu/prof_run.py 5 5 --model /tmp/bc/qwen2.5-0.5b $C --full --batch-size 4 --max-len 2048 --out-dir /tmp/pf > $OUT/prof_full_4x2048.txt 2>&1; grep -E "^step (6|9)/|Self CUDA time" $OUT/prof_full_4x2048.txt
timeout 100 python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --dora --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pd > $OUT/prof_dora.txt 2>&1; grep -E "^step (6|9)/|Self CUDA time" $OUT/prof_dora.txt
timeout 100 python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pl > $OUT/prof_lora.txt 2>&1; grep -E "^step (6|9)/|Self CUDA time" $OUT/prof_lora.txt
date -u
