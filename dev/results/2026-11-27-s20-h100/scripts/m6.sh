#!/usr/bin/env bash
# Session 20, call 6 (the machine of calls 4-5): GRPO in Unsloth (configs D, B) and nanotune's bench_grpo on the same
# models again.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
M=/tmp/trl_methods_models; ls $M
for c in D B; do timeout $(left 60) python3 scripts/bench/bench_grpo.py --model $M/m_$c --tokenizer .anchors/tok --ignore-eos --out $OUT/nt_grpo_$c.json 2>&1 | grep -E "^GRPO" | sed -E "s/ on NVIDIA[^:]*:/:/" | cut -c1-330; done
python3 .anchors/trl_methods.py --methods grpo --systems unsloth --configs D,B --tokenizer .anchors/tok --out /tmp/uns --deadline-s $(left 420) 2>&1 | grep -E "^\| (SmolLM2|Qwen)" | tail -4; cp /tmp/uns/trl_methods_results.json $OUT/unsloth.json
date -u
