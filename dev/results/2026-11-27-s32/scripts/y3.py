"""Session 32, call 3: y2.py's rollouts with the five-launch layers under three rules for the split of K
(`launch_config`): "ceil" (the tree's: programs = tiles x ceil(SMs / tiles), which passes the SM count: a second
wave of a few programs), "floor" (at most one wave where the tiles are fewer than the SMs), "balanced" (the split
s minimizing ceil(programs / SMs) x (blocks a program + 1)); and without them ("off")."""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import kernels.decode_linear as dl
import kernels.decode_swiglu as dsw
from model.config import from_hf_config
from model.load import random_model
from model.generate import GroupSampler
from model.lora import LoRAConfig
from scripts.bench.bench import SHAPES as TRAIN_SHAPES
from scripts.bench.bench_qlora import SHAPES as BIG

def llama(h, i, n, q, kv, v, hd=None, tie=True, arch="LlamaForCausalLM", **kw):
    return dict(architectures=[arch], vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                num_attention_heads=q, num_key_value_heads=kv, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=32768, tie_word_embeddings=tie, **({"head_dim": hd} if hd else {}), **kw)
G3 = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
          sliding_window_pattern=6, rope_local_base_freq=10000.0, head_dim=256)
SHAPES = {
    "smollm2-135m": llama(576, 1536, 30, 9, 3, 49152),
    "qwen2.5-0.5b": llama(896, 4864, 24, 14, 2, 151936, arch="Qwen2ForCausalLM"),
    "gemma-3-270m": llama(640, 2048, 18, 4, 1, 262144, arch="Gemma3ForCausalLM", **G3),
    "llama-3.2-1b": llama(2048, 8192, 16, 32, 8, 128256, hd=64),
    "gemma-3-1b": {**llama(1152, 6912, 26, 4, 1, 262144, arch="Gemma3ForCausalLM", **G3)},
    "qwen2.5-1.5b": llama(1536, 8960, 28, 12, 2, 151936, arch="Qwen2ForCausalLM"),
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], **TRAIN_SHAPES["gemma-2-2b"].sizes},
    "qwen2.5-3b": llama(2048, 11008, 36, 16, 2, 151936, arch="Qwen2ForCausalLM"),
    "llama-3.2-3b": llama(3072, 8192, 28, 24, 8, 128256, hd=128),
    "llama-3.1-8b": BIG["llama-3.1-8b"],
}
import triton
import kernels.decode_qkv as dq

def make(rule):
    def launch_config(tiles, K, x):
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        block_k = 32 if x.dtype == torch.float32 else 128
        blocks = triton.cdiv(K, block_k)
        if rule == "ceil":
            want = max(1, min(blocks, triton.cdiv(sms, tiles)))
        elif rule == "floor":
            want = max(1, min(blocks, sms // tiles))
        else:
            best = None
            for s in range(1, blocks + 1):
                chunk = triton.cdiv(blocks, s)
                eff = triton.cdiv(blocks, chunk)
                cost = triton.cdiv(tiles * eff, sms) * (chunk + 1)
                if best is None or cost < best[0]:
                    best = (cost, s)
            want = best[1]
        chunk = triton.cdiv(blocks, want) * block_k
        return triton.cdiv(K, chunk), chunk, block_k
    return launch_config

dev = torch.device("cuda")
prompts = [list(range(100, 146)), list(range(200, 243))]
only = sys.argv[1:] or ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "llama-3.2-1b", "gemma-2-2b", "qwen2.5-3b",
                        "llama-3.2-3b"]
for name in only:
    cfg = from_hf_config(SHAPES[name], name)
    model = random_model(cfg, dtype=torch.bfloat16, device=dev, use_kernels=True,
                         lora=LoRAConfig(r=16, alpha=16, dropout=0.0))
    with torch.no_grad():
        for _, t in model.named_parameters():
            if t.requires_grad and t.dim() == 2 and t.shape[1] == 16:
                t.normal_(0.0, 0.01, generator=torch.Generator(dev).manual_seed(1))
    model.train()
    fused = model.ops.fused_decode
    out = []
    for mode in ("ceil", "floor", "balanced", "off", "ceil", "floor", "balanced"):
        model.ops.fused_decode = None if mode == "off" else fused
        if mode != "off":
            dl.launch_config = dq.launch_config = dsw.launch_config = make(mode)
        s = GroupSampler(model, rows=16, max_prompt_len=46, max_new_tokens=64, pad_id=0, cuda_graph=True)
        g = torch.Generator(dev)
        for _ in range(2):
            g.manual_seed(0); s(prompts, 8, 1.0, generator=g)
        ts = []
        for i in range(5):
            g.manual_seed(i)
            torch.cuda.synchronize(); t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        out.append(f"{mode} {statistics.median(ts) * 1e3:.1f}")
        del s
    print(f"{name}: " + ", ".join(out) + " ms", flush=True)
    del model; torch.cuda.empty_cache()
