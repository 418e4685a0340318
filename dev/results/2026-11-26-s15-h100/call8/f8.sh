#!/usr/bin/env bash
# DoRA's norms kernel, dm at bandwidth, residual in the scaling op: GPU tests; DoRA vs LoRA step (same call); DoRA profile
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 270 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 90) python3 -m pytest tests/test_kernels.py tests/test_variants.py tests/test_train.py -q -m gpu -k "dora or variants" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -12 > $OUT/tests.txt; tail -4 $OUT/tests.txt
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512"
timeout $(left 60) $B --time-budget $(left 55) --out $OUT/dora.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol"
timeout $(left 50) $B --time-budget $(left 45) --out $OUT/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol"
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12"
timeout $(left 45) python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --dora --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pd > $OUT/prof_dora.txt 2>&1; grep -E "Self CUDA time|_dora" $OUT/prof_dora.txt | cut -c1-60,150-260
date -u
