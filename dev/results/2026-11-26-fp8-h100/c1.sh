#!/usr/bin/env bash
# keep half of the SmolLM2 GGUF for the next call; GPU tests; Llama-3.1-8B QLoRA 2x2048 bf16 vs --fp8 (ckpt off, on+offload)
set -uo pipefail
[ -d .gg1 ] && cp .gg1/p1 /tmp/gguf_p1 &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( ${BUDGET:-570} - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 -m pytest tests/test_fp8_gpu.py tests/test_rl_gpu.py tests/test_rollouts.py tests/test_generate.py tests/test_lora.py -q -m gpu -x 2>&1 | tail -25 > $OUT/tests.txt; tail -3 $OUT/tests.txt
timeout $(left 200) python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_bf16.json --time-budget $(left 190) 2>&1 | grep -E "^\|" | tail -3
timeout $(left 200) python3 scripts/bench/bench_qlora.py --fp8 --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_fp8.json --time-budget $(left 190) 2>&1 | grep -E "^\|" | tail -3
wait; date -u
