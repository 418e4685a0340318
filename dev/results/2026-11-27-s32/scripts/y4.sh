#!/usr/bin/env bash
# Session 32, call 4: the tree with the size rule against .mid (584f5cb), bench_grpo.py at 64 new tokens, alternating:
# a random Gemma-3-270M twice, Gemma-2-2B (now the model's layers again) and Qwen2.5-0.5B once; then the GPU tests
set -uo pipefail; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit --format=csv,noheader; date -u; mkdir -p $OUT
python3 - <<'PY'
import torch, transformers
cfg = transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                    query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                    hidden_activation="gelu_pytorch_tanh")
torch.manual_seed(0)
transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/g3")
PY
run() { local tree=$1 tag=$2 what=$3 name=$4; local d=.; [ $tree = old ] && d=.mid
  (cd $d && python3 scripts/bench/bench_grpo.py $what --tokenizer /work/main/.gpu/tok --ignore-eos --cache-dir /tmp/bc --out $OUT/${name}_${tree}_$tag.json 2>&1 | grep -E "GRPO|Error" | sed "s/^/$name $tree $tag: /"); }
{ for r in 1 2; do run old $r "--model /tmp/g3" gemma3; run new $r "--model /tmp/g3" gemma3; done
  run old 1 "--shape qwen2.5-0.5b" qwen; run new 1 "--shape qwen2.5-0.5b" qwen
  run new 1 "--shape gemma-2-2b" gemma2; run old 1 "--shape gemma-2-2b" gemma2; } 2>&1 | tee $OUT/ab.txt
date -u
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_gemms.py tests/test_generate.py tests/test_rollouts.py tests/test_sample.py tests/test_rl_gpu.py 2>&1 | tail -3 | tee $OUT/tests.txt
date -u
