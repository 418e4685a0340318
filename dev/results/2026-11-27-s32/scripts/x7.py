"""Session 31: a QLoRA (NF4) model's GroupSampler rollout (2 prompts x 8, 64 tokens, T 1.0, seeded), in the tree of
the current directory: median of 7 after 3 warm-ups, the peak memory, and a hash of the greedy tokens. Shapes:
qwen2.5-0.5b (bench.py's random checkpoint, loaded with quantize="nf4") and llama-3.1-8b (bench_qlora.py's config,
model.load.random_model in memory)."""
import argparse, hashlib, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shape", default="qwen2.5-0.5b")
a = p.parse_args()
dev = torch.device("cuda")
cfg, _ = with_hardware_defaults(RLConfig(model="x", batch_size=2, num_generations=8, max_new_tokens=64, beta=None,
                                         loss_type="dapo", num_iterations=1), "cuda")
if a.shape == "llama-3.1-8b":
    from model.load import random_model
    from scripts.bench.bench_qlora import model_config
    model = random_model(model_config(a.shape, False), dtype=torch.bfloat16, device=dev, quantize="nf4",
                         lora=cfg.lora(), use_kernels=True)
else:
    folder = model_folder(argparse.Namespace(model=None, shape=a.shape, smoke=False, cache_dir=a.cache_dir))
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True,
                          quantize="nf4")
with torch.no_grad():
    for _, t in model.named_parameters():
        if t.requires_grad and t.dim() == 2 and t.shape[1] == 16:  # lora_B: not zero, so the adapters matter
            t.normal_(0.0, 0.01, generator=torch.Generator(dev).manual_seed(1))
model.train()
prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
torch.cuda.reset_peak_memory_stats()
s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0, cuda_graph=True)
g = torch.Generator(dev)
for _ in range(3):
    g.manual_seed(0); greedy = s(prompts, 8, 0.0, generator=g)
ts = []
for i in range(7):
    g.manual_seed(i)
    torch.cuda.synchronize(); t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
    ts.append(time.perf_counter() - t0)
h = hashlib.sha1(repr(greedy[0]).encode()).hexdigest()[:12]
print(f"{os.path.basename(os.getcwd()) or 'tree'} {a.shape} NF4: rollout {statistics.median(ts) * 1e3:.1f} ms (min "
      f"{min(ts) * 1e3:.1f}); merged groups {len(s.merged.groups)}; peak {torch.cuda.max_memory_allocated() / 2**30:.2f}"
      f" GiB; greedy tokens {h}", flush=True)
