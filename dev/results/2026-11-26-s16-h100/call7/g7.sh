#!/usr/bin/env bash
# after merging dora6 (DoRA norms, 64 rows of one member) and glu (no second activation pass, residual adds fused): the GPU suite; DoRA vs LoRA; DoRA profile
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT; cp .gg1/p1 /tmp/gguf_p1
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 330) python3 -m pytest tests -q -m gpu --ignore=tests/test_rl_gpu.py -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|error" | tail -20 > $OUT/tests.txt; tail -8 $OUT/tests.txt
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512"
timeout $(left 50) $B --time-budget $(left 45) --out $OUT/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol" | head -1
timeout $(left 45) $B --time-budget $(left 40) --out $OUT/dora.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol" | head -1
timeout $(left 45) $B --time-budget $(left 40) --out $OUT/lora2.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol" | head -1
C="--tokenizer .anchors/tok --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --max-steps 12"
timeout $(left 50) python3 .gpu/prof_run.py 5 5 --model /tmp/bc/smollm2-135m $C --dora --gradient-checkpointing --batch-size 8 --max-len 512 --out-dir /tmp/pd > $OUT/prof_dora.txt 2>&1; grep -E "Self CUDA time|_dora" $OUT/prof_dora.txt | cut -c1-60,150-260
date -u
