#!/usr/bin/env bash
# Session 20, call 3: programmatic dependent launch for the decoding kernels (PDL_MODE, default prefetch): the GPU
# tests of decoding; pdl.py's modes alternating on both shapes.
set -uo pipefail
R=$PWD
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 -m pytest tests/test_decode_gemms.py tests/test_kernels_decode.py tests/test_generate.py tests/test_rollouts.py -q -m gpu -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -8 | tee $OUT/tests.txt
timeout $(left 300) python3 .gpu/pdl.py --tokenizer $R/.gpu/tok 2>&1 | grep -v -E "Writing model|Warn|warn" | tail -20 | tee $OUT/pdl.txt
date -u
