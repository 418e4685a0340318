#!/usr/bin/env bash
# fold A/B: GPU tests of the folded adapters and the NF4 kernel; Llama-3.1-8B QLoRA 2x2048 off and on+offload, main (.old6) vs fold, twice alternating
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 100) python3 -m pytest tests/test_nf4.py tests/test_qlora.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error|assert" | tail -15
for t in .old6 . .old6 .; do (cd $t && timeout $(left 110) python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_$(basename $(realpath .))_$SECONDS.json --time-budget $(left 105) 2>&1 | grep -E "^\| llama" | sed "s/^/$t /"); done
date -u
