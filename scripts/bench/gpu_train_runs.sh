#!/usr/bin/env bash
# GPU check of train.py: 50 steps on a random-init model with
# TinyLlama's real shape (no download is possible on the GPU machine), bf16 and fp16, packing on
# and off. The tokenizer is the tests' tiny byte-level BPE (vocab 400 <= the model's 32000).
# Usage: bash scripts/bench/gpu_train_runs.sh CHECKPOINT_FOLDER OUT_FOLDER
set -euo pipefail
ckpt=$1; out=$2
python3 -c "import sys; sys.path.insert(0, '.'); from tests.tiny_tokenizer import make_test_tokenizer; make_test_tokenizer('$ckpt')"
for dtype in bf16 fp16; do
  for packing in packing no-packing; do
    name=$dtype-$packing
    python3 train.py --model "$ckpt" --dtype $dtype --$packing --max-steps 50 --eval-every 25 --save-every 50 \
      --out-dir "$out/$name" --overwrite --log-every 10 2>&1 | tee "$out/$name.log" | grep -E "^step (10|20|30|40|50)/|^eval|error|device" || true
  done
done
