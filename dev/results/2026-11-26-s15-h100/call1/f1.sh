#!/usr/bin/env bash
# decoding attention per query head: GPU tests + GRPO profiles; nanotune full fine-tuning, SmolLM2 and Qwen2.5-0.5B shapes, 8x512 and 4x2048, ckpt off/on
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whlb/*.whl .whl2/*.whl .whl3/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader; date -u
mkdir -p $OUT
left() { local l=$(( 585 - SECONDS )); (( l > $1 )) && echo $1 || echo $(( l > 5 ? l : 5 )); }
timeout $(left 110) python3 -m pytest tests/test_kernels_decode.py tests/test_generate.py tests/test_rollouts.py -q -m gpu 2>&1 | grep -E "FAILED|passed|failed|Error" | tail -20 > $OUT/tests.txt; tail -3 $OUT/tests.txt
G="python3 scripts/bench/bench_grpo.py --tokenizer .anchors/tok --ignore-eos --profile --cache-dir /tmp/bc"
timeout $(left 75) $G --shape smollm2-135m --out /tmp/g1.json > $OUT/grpo_D.txt 2>&1; grep -E "^GRPO|launched|decode_att" $OUT/grpo_D.txt | head -5
timeout $(left 75) $G --shape qwen2.5-0.5b --out /tmp/g2.json > $OUT/grpo_B.txt 2>&1; grep -E "^GRPO|launched|decode_att" $OUT/grpo_B.txt | head -5
for s in smollm2-135m qwen2.5-0.5b; do for bt in "8 512" "4 2048"; do set -- $bt; for ck in off on; do
  o=/tmp/full_${s}_$1x$2_$ck; f=""; [ $ck = on ] && f="--gradient-checkpointing --offload-activations"
  timeout $(left 45) python3 train.py --model /tmp/bc/$s --tokenizer .anchors/tok --full --batch-size $1 --max-len $2 --max-steps 12 --log-every 1 --eval-every 0 --save-every 0 --sample-every 0 $f --out-dir $o > $o.log 2>&1
  echo "== $s $1x$2 ckpt $ck"; grep -E "^full fine|^gradient check|Error|error" $o.log | cut -c1-200; python3 .gpu/fsum.py $o
  cat $o.log >> $OUT/full_logs.txt
done; done; done 2>&1 | tee $OUT/full_summary.txt | grep -v "^full fine\|^gradient"
date -u
