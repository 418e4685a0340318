#!/usr/bin/env bash
# Session 31, call 6: bench_grpo.py on a second machine, .mid (acdfee4) against the tree (5af00ac): Qwen2.5-0.5B at
# 64 tokens alternating twice, then at 128 tokens once each; SmolLM2-135M at 128 tokens once each
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
run() { local tree=$1 shape=$2 n=$3 tag=$4; local d=.; [ $tree = old ] && d=.mid
  (cd $d && python3 scripts/bench/bench_grpo.py --shape $shape --tokenizer /work/main/.gpu/tok --ignore-eos --cache-dir /tmp/bc --max-new-tokens $n --out $OUT/${shape}_${n}_${tree}_$tag.json 2>&1 | grep GRPO | sed "s/^/$tree $tag: /"); }
{ for r in 1 2; do run old qwen2.5-0.5b 64 $r; run new qwen2.5-0.5b 64 $r; done
  run old qwen2.5-0.5b 128 1; run new qwen2.5-0.5b 128 1; run old smollm2-135m 128 1; run new smollm2-135m 128 1; } 2>&1 | tee $OUT/ab.txt
date -u
