#!/usr/bin/env bash
# full fine-tuning: nanotune (train.py --full), HF(+Liger) fp32 masters, Unsloth fp32 mixed, SmolLM2 (D) and Qwen2.5-0.5B (B) shapes, 8x512
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
python3 .anchors/trl_methods.py --prepare --configs D,B --tokenizer .anchors/tok > /dev/null 2>&1; ls /tmp/trl_methods_models
for c in D B; do
  timeout 100 python3 train.py --model /tmp/trl_methods_models/m_$c --tokenizer .anchors/tok --full --batch-size 8 --max-len 512 --max-steps 14 --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --gradient-checkpointing --out-dir /tmp/full_$c > /tmp/full_$c.log 2>&1
  tail -2 /tmp/full_$c.log; python3 -c "
import json,statistics as s; r=[json.loads(l) for l in open('/tmp/full_$c/metrics.jsonl') if 'tokens_per_s' in l]
r=r[3:]; print('nanotune full $c 8x512: median tok/s', s.median(x['tokens_per_s'] for x in r), 'peak', max(x.get('peak_mem_gib',x.get('peak_memory_gib',0)) for x in r), 'keys', sorted(r[0]))"
  cat /tmp/full_$c.log /tmp/full_$c/metrics.jsonl >> $OUT/nanotune_full.log
done
timeout 200 python3 .anchors/hf_baseline.py --full --master fp32 --configs D,B --batch 8 --seq 512 --out $OUT/hf_full --deadline-s 190 2>&1 | tail -8
timeout 230 python3 .anchors/unsloth_bench.py --full --master fp32 --configs D,B --batch 8 --seq 512 --out $OUT/unsloth_full 2>&1 | tail -6
date -u
