#!/usr/bin/env bash
# half of the SmolLM2 GGUF kept for the next call; GPU tests of the merged sampler and DoRA; GRPO nanotune vs Unsloth vs TRL (D), nanotune B
set -uo pipefail
cp .gg1/p1 /tmp/gguf_p1 &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 560 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 120) python3 -m pytest tests/test_rl_gpu.py tests/test_rollouts.py tests/test_generate.py tests/test_variants.py tests/test_train.py -q -m gpu -k "not ddp" 2>&1 | tail -12 > $OUT/tests.txt; tail -3 $OUT/tests.txt
python3 .anchors/trl_methods.py --methods grpo --systems unsloth,trl --configs D --tokenizer .anchors/tok --out /tmp/p1 --deadline-s $(left 240) 2>&1 | grep -E "^\| SmolLM2" | tail -3; cp /tmp/p1/trl_methods_results.json $OUT/p1.json
M=/tmp/trl_methods_models
timeout $(left 60) python3 scripts/bench/bench_grpo.py --model $M/m_D --tokenizer .anchors/tok --ignore-eos --out $OUT/nt_grpo_D.json 2>&1 | tail -1
timeout $(left 60) python3 .anchors/trl_methods.py --prepare --config B --tokenizer .anchors/tok > /dev/null 2>&1; ls $M
timeout $(left 60) python3 scripts/bench/bench_grpo.py --model $M/m_B --tokenizer .anchors/tok --ignore-eos --out $OUT/nt_grpo_B.json 2>&1 | tail -1
wait; ls -la /tmp/gguf_p1; date -u
