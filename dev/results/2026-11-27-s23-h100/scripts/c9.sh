#!/usr/bin/env bash
# Session 23, call 9: the projections' flags set through the instance dict (read_as) against the commit before
# (.oldrd): phases.py alternating twice.
set -uo pipefail
R=$PWD
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for r in 1 2; do for t in .oldrd .; do
  (cd $t && timeout $(left 100) python3 $R/.gpu/phases.py --tokenizer $R/.gpu/tok 2>&1 | grep -E "call|Error|error" | sed "s/^/$r $t /" | tee -a $OUT/phases.txt)
done; done
date -u
