#!/usr/bin/env bash
# Session 31, call 13: BLOCK_N by the weight's width. .mid (dcc20b6) against the tree: the QLoRA Llama-3.1-8B
# rollout (x7.py) twice; bench_grpo.py TinyLlama and Qwen2.5-0.5B at 64 tokens, alternating twice; then GPU tests
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
{ for r in 1; do for d in .mid .; do
  (cd $d && timeout 150 python3 /work/main/.gpu/x7.py --tokenizer /work/main/.gpu/tok --shape llama-3.1-8b 2>&1 | grep -E "NF4|rror" | sed "s/^/$d $r: /"); done; done
  for shape in tinyllama qwen2.5-0.5b; do for r in 1 2; do for d in .mid .; do
  (cd $d && python3 scripts/bench/bench_grpo.py --shape $shape --tokenizer /work/main/.gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/${shape}_$(basename $d)_$r.json 2>&1 | grep GRPO | sed "s/^/$d $r: /"); done; done; done; } 2>&1 | tee $OUT/ab.txt
date -u
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py tests/test_rl_gpu.py 2>&1 | tail -2 | tee $OUT/tests.txt
date -u
