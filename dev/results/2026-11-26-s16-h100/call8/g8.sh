#!/usr/bin/env bash
# glu A/B (.old4 = before dora6+glu... before glu: bb3f637) on Llama-3.1-8B QLoRA and SmolLM2; dec3 (.wtd) GPU tests and GRPO five vs nine kernels; fp8 curve 200 steps
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 580 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
(cd .wtd && timeout $(left 90) python3 -m pytest tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -10 > $OUT/tests_dec3.txt); tail -5 $OUT/tests_dec3.txt
for t in .old4 .; do (cd $t && timeout $(left 90) python3 scripts/bench/bench_qlora.py --shapes llama-3.1-8b --ckpt off,on+offload --long-shapes none --out $OUT/q_$(basename $(realpath .)).json --time-budget $(left 85) 2>&1 | grep -E "^\| llama" | sed "s/^/$t /"); done
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512 --step-opts cuda_graphs=on"
for t in .old4 . .old4 .; do (cd $t && timeout $(left 40) $B --time-budget $(left 35) --out /tmp/s.json 2>&1 | grep -E "^\| smol" | head -1 | sed "s/^/$t /"); done
if [ -f /tmp/gguf_p1 ]; then cat /tmp/gguf_p1 .gg2/p2 > /tmp/smollm2.gguf; timeout $(left 200) python3 scripts/bench/fp8_curve.py --model /tmp/smollm2.gguf --steps 200 --out $OUT/fp8_curve.jsonl > $OUT/fp8.log 2>&1; tail -2 $OUT/fp8.log; else echo "no gguf half on this machine"; fi
date -u
