"""Session 33, call 4: where a nine-launch decoding step's GPU time goes after this session's changes. A GroupSampler
rollout (2 prompts x 8, 64 tokens, merged LoRA r=16, random bf16 weights) of Gemma-3-1B, Gemma-2-2B and Qwen3-4B
under torch.profiler (CUDA kernels only), after 2 warm-ups: each kernel's count and GPU time over the rollout, the
busy total against the wall, and the launches of one decoding step."""
import os, sys, time, collections
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import profile, ProfilerActivity
from model.config import from_hf_config
from model.load import random_model
from model.generate import GroupSampler
from model.lora import LoRAConfig
from scripts.bench.bench import SHAPES as TRAIN_SHAPES

def llama(h, i, n, q, kv, v, hd=None, tie=True, arch="LlamaForCausalLM", **kw):
    return dict(architectures=[arch], vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                num_attention_heads=q, num_key_value_heads=kv, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=32768, tie_word_embeddings=tie, **({"head_dim": hd} if hd else {}), **kw)
G3 = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
          sliding_window_pattern=6, rope_local_base_freq=10000.0, head_dim=256)
SHAPES = {
    "gemma-3-1b": llama(1152, 6912, 26, 4, 1, 262144, arch="Gemma3ForCausalLM", **G3),
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], **TRAIN_SHAPES["gemma-2-2b"].sizes},
    "qwen3-4b": llama(2560, 9728, 36, 32, 8, 151936, hd=128, arch="Qwen3ForCausalLM"),
}
dev = torch.device("cuda")
prompts = [list(range(100, 146)), list(range(200, 243))]
for name, hf in SHAPES.items():
    cfg = from_hf_config(hf, name)
    model = random_model(cfg, dtype=torch.bfloat16, device=dev, use_kernels=True,
                         lora=LoRAConfig(r=16, alpha=16, dropout=0.0))
    model.train()
    s = GroupSampler(model, rows=16, max_prompt_len=46, max_new_tokens=64, pad_id=0, cuda_graph=True)
    g = torch.Generator(dev)
    for _ in range(2):
        g.manual_seed(0); s(prompts, 8, 1.0, generator=g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter(); g.manual_seed(1); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]; a[0] += 1; a[1] += e.device_time_total
    busy = sum(v[1] for v in agg.values()) / 1e3
    launches = sum(v[0] for v in agg.values())
    print(f"== {name}: wall {wall * 1e3:.1f} ms, kernels busy {busy:.1f} ms, {launches} launches "
          f"({launches / 63:.0f} a step over 63 decoding steps, prefill included)", flush=True)
    for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"  {us / 1e3:8.2f} ms  {n:6d}  {us / max(n, 1):7.2f} us  {k}", flush=True)
    del s, model; torch.cuda.empty_cache()
