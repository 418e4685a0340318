#!/usr/bin/env bash
# Session 23, call 7: launch_config's 32 x 128 tiles at ranks up to 16 for every DoRA-norm and merge launch: GPU
# tests (kernels' DoRA and merge tables, DoRA variants), normbench (the tree's line), and a DoRA step (SmolLM2-135M,
# 8 x 512, ckpt off) of the session's start (.old23) and this tree, alternating twice.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
timeout $(left 200) python3 -m pytest tests/test_kernels.py tests/test_variants.py tests/test_lora.py -q -m gpu -k "dora or merge or DoRA" -p no:cacheprovider 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -6 | tee $OUT/tests.txt
timeout $(left 60) python3 .gpu/normbench.py 2>&1 | grep -E "^tree" | tee $OUT/norms.txt
for r in 1 2; do for t in .old23 .; do
  (cd $t && timeout $(left 90) python3 scripts/bench/bench.py --cases nanotune --shapes smollm2-135m --ckpt off --batch 8 --seqlen 512 --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "nanotune|Error" | tail -2 | sed "s/^/$r $t /" | tee -a $OUT/dora.txt)
done; done
date -u
