#!/usr/bin/env bash
# the small rows on main (after dora6 + glu), and the peak memory of TinyLlama / Qwen2.5-0.5B on+offload beside the tree of the docs' first table (c973559, .old5)
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u; mkdir -p $OUT
left() { local l=$(( 400 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
B="python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --step-opts cuda_graphs=on"
timeout $(left 190) $B --shapes tinyllama,qwen2.5-0.5b --ckpt off,on+offload --time-budget $(left 185) --out $OUT/small.json 2>&1 | grep -E "^\| (tiny|qwen)" | sort -u
timeout $(left 50) $B --shapes smollm2-135m --ckpt off,on+offload --time-budget $(left 45) --out $OUT/smol.json 2>&1 | grep -E "^\| smol" | sort -u
(cd .old5 && timeout $(left 120) $B --shapes tinyllama,qwen2.5-0.5b --ckpt on+offload --time-budget $(left 115) --out $OUT/old5.json 2>&1 | grep -E "^\| (tiny|qwen)" | sort -u | sed "s/^/c973559 /")
date -u
