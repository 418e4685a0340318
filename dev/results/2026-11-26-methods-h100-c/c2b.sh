#!/usr/bin/env bash
# the real SmolLM2-135M-Instruct: GRPO and DPO runs (scripts/real_run.py), the fp8 loss curve; DoRA vs LoRA graphed
set -uo pipefail
cat /tmp/gguf_p1 .gg2/p2 > /tmp/smollm2.gguf; md5sum /tmp/smollm2.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT; G=/tmp/smollm2.gguf
left() { local l=$(( 570 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 200) python3 scripts/real_run.py rl --model $G --out /tmp/rl > $OUT/rl.log 2>&1; tail -4 $OUT/rl.log; cp /tmp/rl/metrics.jsonl $OUT/rl_metrics.jsonl
timeout $(left 180) python3 scripts/real_run.py dpo --model $G --out /tmp/dpo > $OUT/dpo.log 2>&1; tail -4 $OUT/dpo.log; find /tmp/dpo -name metrics.jsonl | head -1 | xargs -I{} cp {} $OUT/dpo_metrics.jsonl
timeout $(left 150) python3 scripts/bench/fp8_curve.py --model $G --steps 200 --out $OUT/fp8_curve.jsonl > $OUT/fp8.log 2>&1; tail -3 $OUT/fp8.log
timeout $(left 60) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512 --time-budget $(left 55) --out /tmp/dora.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| smol"
timeout $(left 40) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m --ckpt on --batch 8 --seqlen 512 --time-budget $(left 35) --out /tmp/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| smol"
date -u
