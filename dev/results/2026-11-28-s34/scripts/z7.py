"""Session 34, call 2: the merge with W a tile ahead, .mid (HEAD) against the tree. A GroupSampler rollout (2 prompts
x 8, 64 tokens, T 1.0, seeded, merged LoRA r=16 adapters) of random bf16 Qwen3-4B (nine launches) and Qwen2.5-0.5B
(five launches), in the tree of the working directory; median of 7 after 2 warm-ups, twice; the sampled tokens' sha1."""
import hashlib, json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
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
    "qwen3-4b": llama(2560, 9728, 36, 32, 8, 151936, hd=128, arch="Qwen3ForCausalLM"),
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], **TRAIN_SHAPES["qwen2.5-0.5b"].sizes},
}
tag, out_path = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
prompts = [list(range(100, 146)), list(range(200, 243))]
res = {}
for name, hf in SHAPES.items():
    cfg = from_hf_config(hf, name)
    model = random_model(cfg, dtype=torch.bfloat16, device=dev, use_kernels=True,
                         lora=LoRAConfig(r=16, alpha=16, dropout=0.0))
    with torch.no_grad():
        for _, t in model.named_parameters():
            if t.requires_grad and t.dim() == 2 and t.shape[1] == 16:
                t.normal_(0.0, 0.01, generator=torch.Generator(dev).manual_seed(1))
    model.train()
    fused = model.ops.fused_decode
    for mode in ("default", "default"):
        model.ops.fused_decode = None if mode == "off" else fused
        s = GroupSampler(model, rows=16, max_prompt_len=46, max_new_tokens=64, pad_id=0, cuda_graph=True)
        g = torch.Generator(dev)
        for _ in range(2):
            g.manual_seed(0); s(prompts, 8, 1.0, generator=g)
        ts, toks = [], []
        for i in range(7):
            g.manual_seed(i)
            torch.cuda.synchronize(); t0 = time.perf_counter(); o = s(prompts, 8, 1.0, generator=g)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
            toks.append(repr(o[0]))
        key = f"{name} {mode}"
        ms = statistics.median(ts) * 1e3
        res.setdefault(key, []).append(ms)
        res[key + " sha1"] = hashlib.sha1("".join(toks).encode()).hexdigest()[:12]
        print(f"{tag} {key}: {ms:.1f} ms  tokens {res[key + ' sha1']}", flush=True)
        del s
    del model; torch.cuda.empty_cache()
json.dump(res, open(out_path, "w"), indent=1)
