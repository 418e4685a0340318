#!/usr/bin/env bash
# the real SmolLM2-135M-Instruct (GGUF carried in two halves): GRPO and DPO runs (scripts/real_run.py), the fp8 loss curve
set -uo pipefail
export PYTHONPATH=/tmp/site
cat /tmp/gguf_p1 .gg2/p2 > /tmp/smollm2.gguf; md5sum /tmp/smollm2.gguf
date -u; mkdir -p $OUT; G=/tmp/smollm2.gguf
left() { local l=$(( 330 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 150) python3 scripts/real_run.py rl --model $G --out /tmp/rl --steps 100 > $OUT/rl.log 2>&1; tail -4 $OUT/rl.log; cp /tmp/rl/metrics.jsonl $OUT/rl_metrics.jsonl
timeout $(left 110) python3 scripts/real_run.py dpo --model $G --out /tmp/dpo --steps 40 > $OUT/dpo.log 2>&1; tail -4 $OUT/dpo.log; find /tmp/dpo -name metrics.jsonl | head -1 | xargs -I{} cp {} $OUT/dpo_metrics.jsonl
timeout $(left 100) python3 scripts/bench/fp8_curve.py --model $G --steps 100 --out $OUT/fp8_curve.jsonl > $OUT/fp8.log 2>&1; tail -3 $OUT/fp8.log
date -u
