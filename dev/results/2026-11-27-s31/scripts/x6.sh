#!/usr/bin/env bash
# Session 31, call 8: a random Qwen3-0.6B, bench_grpo.py at 64 tokens, .mid (42cbb72, Qwen3 on the general decoding
# layers) against the tree (fb588e2, five launches), alternating twice; then the GPU tests of the decoding kernels,
# generation, rollouts, sampling and RL
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
python3 - <<'PY'
import torch, transformers
cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                               max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/q3")
PY
run() { local tree=$1 tag=$2; local d=.; [ $tree = old ] && d=.mid
  (cd $d && python3 scripts/bench/bench_grpo.py --model /tmp/q3 --tokenizer /work/main/.gpu/tok --ignore-eos --out $OUT/qwen3_${tree}_$tag.json 2>&1 | grep GRPO | sed "s/^/$tree $tag: /"); }
{ for r in 1 2; do run old $r; run new $r; done; } 2>&1 | tee $OUT/ab.txt
date -u
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py tests/test_sample.py tests/test_rl_gpu.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
