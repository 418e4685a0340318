#!/usr/bin/env bash
# Session 39, call 8: the GPU tests of what changed (LoRA's gradient GEMMs, full fine-tuning's projections, the fused head), serially
set -uo pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
mkdir -p $OUT; date -u
timeout -s INT 200 python3 -m pytest -q -rfE -m gpu -W ignore tests/test_lora.py tests/test_gpu_model.py "tests/test_train.py::test_variants_replay_from_cuda_graphs_as_they_run_eagerly" > $OUT/gpu_a.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_a.txt | cut -c1-250 | head -30; tail -1 $OUT/gpu_a.txt; date -u
timeout -s INT 100 python3 -m pytest -q -rfE -m gpu -W ignore tests/test_kernels.py -k "linear_cross" > $OUT/gpu_b.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  " $OUT/gpu_b.txt | cut -c1-250 | head -30; tail -1 $OUT/gpu_b.txt; date -u
