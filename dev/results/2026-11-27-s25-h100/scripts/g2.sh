#!/usr/bin/env bash
# Session 25: one chunk of logits at a time: GPU tests of the fused loss and scoring; SmolLM2's peak breakdown; the
# small on+offload rows (bench.py) and Llama-3.1-8B QLoRA 2x2048 on+offload (bench_qlora.py)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 90) python3 -m pytest tests/test_kernels.py tests/test_gpu_model.py -q -m gpu -k "cross_entropy or score" -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -6 | tee $OUT/tests.txt
timeout $(left 60) python3 .gpu/mempeak.py smollm2-135m 8x512 on+offload 2>&1 | grep -v Warn | head -8 | tee $OUT/mempeak.txt
timeout $(left 200) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --step-opts cuda_graphs=on --shapes smollm2-135m,tinyllama,qwen2.5-0.5b --ckpt on+offload --out $OUT/small.json 2>&1 | grep -E "^\| (smollm2|tinyllama|qwen)" | sort -u | tee $OUT/small.txt
timeout $(left 150) python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt on+offload --long-shapes none --out $OUT/llama.json --time-budget $(left 140) 2>&1 | grep -E "^\| llama" | tee $OUT/llama.txt
date -u
