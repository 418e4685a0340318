#!/usr/bin/env bash
# softcap attention GPU tests + Gemma-2-9B QLoRA step; DoRA tests and DoRA vs LoRA on main and on branch dora5 (.wt5), same call
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 560 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 100) python3 -m pytest tests/test_softcap_attention.py tests/test_gpu_model.py tests/test_kernels.py tests/test_variants.py -q -m gpu -k "softcap or gemma or dora" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -14 > $OUT/tests_main.txt; tail -6 $OUT/tests_main.txt
(cd .wt5 && timeout $(left 90) python3 -m pytest tests/test_kernels.py tests/test_variants.py -q -m gpu -k "dora or variants" 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -14 > $OUT/tests_dora5.txt); tail -6 $OUT/tests_dora5.txt
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512"
timeout $(left 45) $B --time-budget $(left 40) --out $OUT/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol" | head -1
timeout $(left 45) $B --time-budget $(left 40) --out $OUT/dora_main.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol" | head -1
(cd .wt5 && timeout $(left 45) $B --time-budget $(left 40) --out $OUT/dora5.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol" | head -1)
timeout $(left 45) $B --time-budget $(left 40) --out $OUT/lora2.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol" | head -1
timeout $(left 150) python3 scripts/bench/bench_qlora.py --shapes gemma-2-9b --ckpt off,on+offload --long-shapes none --out $OUT/gemma.json --time-budget $(left 145) 2>&1 | grep -E "^\| gemma"
date -u
