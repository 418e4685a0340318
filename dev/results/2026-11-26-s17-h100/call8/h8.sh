#!/usr/bin/env bash
# Session 17, call 8 (final tree): GPU tests of the areas changed this session; GRPO in TRL + PEFT (configs D, B).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 230) python3 -m pytest tests/test_kernels.py tests/test_kernels_decode.py tests/test_sample.py tests/test_lora.py tests/test_variants.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py tests/test_step.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 > $OUT/tests.txt; tail -4 $OUT/tests.txt
python3 .anchors/trl_methods.py --methods grpo --systems trl --configs D,B --tokenizer .anchors/tok --out /tmp/trl --deadline-s $(left 330) 2>&1 | grep -E "^\| (SmolLM2|Qwen)" | tail -4; cp /tmp/trl/trl_methods_results.json $OUT/trl.json
date -u
