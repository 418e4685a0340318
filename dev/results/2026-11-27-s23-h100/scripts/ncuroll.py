"""One GroupSampler rollout of a shape under ncu: 3 warm-up rollouts, then cudaProfilerStart and one more rollout,
so that ncu (--profile-from-start off) sees only the measured rollout's kernels."""
import argparse, os, sys
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
ns = argparse.Namespace(model=None, shape=a.shape, smoke=False, cache_dir=a.cache_dir)
folder = model_folder(ns)
cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                         beta=None, loss_type="dapo", num_iterations=1), "cuda")
model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0, cuda_graph=True)
g = torch.Generator(dev)
for _ in range(2):
    g.manual_seed(0); s(prompts, 8, 1.0, generator=g)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
s(prompts, 8, 1.0, generator=g)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done", a.shape, flush=True)
