#!/usr/bin/env bash
# GPU tests of the new paths; GRPO (SmolLM2 D, Qwen B) nanotune vs TRL (+Unsloth on D); DPO on B; full FT; DoRA graphed
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 575 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 170) python3 -m pytest tests/test_fp8_gpu.py tests/test_rl_gpu.py tests/test_rollouts.py tests/test_train.py -q -m gpu -k "not ddp" 2>&1 | grep -E "passed|failed|FAILED|Error|error" | head -30 | tee $OUT/tests.txt
python3 .anchors/trl_methods.py --methods grpo --systems trl,unsloth --configs D --tokenizer .anchors/tok --out /tmp/p1 --deadline-s $(left 190) 2>&1 | grep -E "^\|" | tail -4; cp /tmp/p1/trl_methods_results.json $OUT/p1.json
M=/tmp/trl_methods_models
timeout $(left 70) python3 scripts/bench/bench_grpo.py --model $M/m_D --tokenizer .anchors/tok --ignore-eos --out $OUT/nt_grpo_D.json 2>&1 | tail -4
python3 .anchors/trl_methods.py --methods dpo,grpo --systems trl --configs B --tokenizer .anchors/tok --prompt-len 256 --completion-len 256 --out /tmp/p2 --deadline-s $(left 150) 2>&1 | grep -E "^\|" | tail -4; cp /tmp/p2/trl_methods_results.json $OUT/p2.json
timeout $(left 60) python3 scripts/bench/bench_grpo.py --model $M/m_B --tokenizer .anchors/tok --ignore-eos --out /tmp/nt_grpo_B.json 2>&1 | tail -3
timeout $(left 60) python3 scripts/bench/bench_dpo.py --model $M/m_B --tokenizer .anchors/tok --out /tmp/nt_dpo_B.json --pairs-per-step 8 --prompt-len 256 --completion-len 256 -- --gradient-checkpointing 2>&1 | tail -3
python3 -c "import json,sys; json.dump({k: json.load(open(f'/tmp/{k}.json')) for k in ['nt_grpo_B','nt_dpo_B'] if __import__('os').path.exists(f'/tmp/{k}.json')}, open('$OUT/nt_B.json','w'))"
for c in D B; do
  timeout $(left 60) python3 train.py --model $M/m_$c --tokenizer .anchors/tok --full --batch-size 8 --max-len 512 --max-steps 14 --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 --gradient-checkpointing --out-dir /tmp/full_$c > /tmp/full_$c.log 2>&1
  python3 -c "
import json,statistics as s; r=[json.loads(l) for l in open('/tmp/full_$c/metrics.jsonl') if 'tokens_per_s' in l]; r=r[3:]
print('nanotune full $c 8x512 ckpt+offload: median tok/s', s.median(x['tokens_per_s'] for x in r), {k: v for k, v in r[-1].items() if 'mem' in k})"
  cat /tmp/full_$c.log /tmp/full_$c/metrics.jsonl >> $OUT/full.log
done
timeout $(left 100) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m,qwen2.5-0.5b --ckpt on --batch 8 --seqlen 512 --time-budget $(left 90) --out $OUT/dora.json --step-opts cuda_graphs=on,dora=true 2>&1 | grep -E "^\| (smol|qwen)"
timeout $(left 60) python3 scripts/bench/bench.py --cache-dir /tmp/bc --cases nanotune --shapes smollm2-135m,qwen2.5-0.5b --ckpt on --batch 8 --seqlen 512 --time-budget $(left 50) --out /tmp/lora.json --step-opts cuda_graphs=on 2>&1 | grep -E "^\| (smol|qwen)"
date -u
