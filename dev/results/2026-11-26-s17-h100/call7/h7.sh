#!/usr/bin/env bash
# Session 17, call 7: where a rollout's GPU sits idle (gaps.py) on main, dattn (.wta) and combo (.wtc), both shapes.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
for s in qwen2.5-0.5b smollm2-135m; do for t in . .wta .wtc; do (cd $t && timeout 60 python3 $OLDPWD/.gpu/gaps.py --shape $s --tokenizer $OLDPWD/.gpu/tok 2>&1 | grep -v -i warn | sed "s/^/$t /"); done; done | tee $OUT/gaps.txt
date -u
