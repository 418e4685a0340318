#!/usr/bin/env bash
# merged helpers: GPU tests (fp8 group kernel, offload, DoRA kernels, masters), fp8 bench, full FT Qwen, DoRA vs LoRA
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
python3 scripts/bench/bench.py --make-checkpoint qwen2.5-0.5b --cache-dir /tmp/bc > /dev/null 2>&1 &
timeout $(left 170) python3 -m pytest tests/test_fp8_gpu.py tests/test_offload.py tests/test_kernels.py tests/test_variants.py tests/test_train.py tests/test_step.py -q -m gpu -k "not ddp" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -30 > $OUT/tests.txt; tail -4 $OUT/tests.txt
timeout $(left 40) python3 scripts/bench/bench_nf4.py > $OUT/nf4.txt 2>&1; grep -E "llama-3.1-8b" $OUT/nf4.txt | head -12
timeout $(left 100) python3 scripts/bench/bench_qlora.py --fp8 --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_fp8.json --time-budget $(left 95) 2>&1 | grep -E "^\| llama" | tail -2
wait
timeout $(left 70) python3 train.py --model /tmp/bc/qwen2.5-0.5b --tokenizer .anchors/tok --full --batch-size 8 --max-len 512 --max-steps 14 --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --out-dir /tmp/full_B > $OUT/full.log 2>&1; grep -E "^step (1|2|8|14)/|checkpointing|full fine" $OUT/full.log | cut -c1-160
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512"
timeout $(left 60) $B --time-budget $(left 55) --out /tmp/dora.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol"
timeout $(left 50) $B --time-budget $(left 45) --out /tmp/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol"
date -u
