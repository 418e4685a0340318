#!/usr/bin/env bash
# Session 31, call 9: QLoRA (NF4) rollouts, .mid (e6f2ab0: the adapter path, NF4 dequantized at every step) against
# the tree (the NF4 base merged once a rollout), alternating twice per shape; then the GPU tests of LoRA, QLoRA,
# rollouts, generation, decoding kernels and RL
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
for shape in qwen2.5-0.5b llama-3.1-8b; do for r in 1 2; do for d in .mid .; do
  (cd $d && timeout 150 python3 /work/main/.gpu/x7.py --tokenizer /work/main/.gpu/tok --shape $shape 2>&1 | grep -E "NF4|Error|error" | sed "s/^/$d $r: /")
done; done; done 2>&1 | tee $OUT/ab.txt
date -u
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora.py tests/test_qlora.py tests/test_rollouts.py tests/test_generate.py tests/test_rl_gpu.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
