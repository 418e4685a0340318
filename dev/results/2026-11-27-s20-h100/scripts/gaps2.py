"""Where a rollout's GPU time goes (busy per kernel) and where it sits idle: torch.profiler over one sampler call (64 tokens, Qwen2.5-0.5B shape), the CUDA
kernels sorted by start; busy time, idle time, and the idle time before each kernel name (the top ones)."""
import argparse, collections, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--shape"); p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
a = p.parse_args(); a.model = None; a.smoke = False
dev = torch.device("cuda")
folder = model_folder(a)
cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64, beta=None,
                                         loss_type="dapo", num_iterations=1), "cuda")
model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0, cuda_graph=True)
g = torch.Generator(dev).manual_seed(0)
for _ in range(3):
    s(prompts, 8, 1.0, generator=g)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize(); wall = time.perf_counter() - t0
ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
busy = sum(e.time_range.end - e.time_range.start for e in ev)
span = ev[-1].time_range.end - ev[0].time_range.start
idle = collections.Counter(); n = collections.Counter(); end = ev[0].time_range.start
big = []
for e in ev:
    gap = e.time_range.start - end
    if gap > 0:
        idle[e.name[:60]] += gap; n[e.name[:60]] += 1
        if gap > 20: big.append((gap, e.name[:60]))
    end = max(end, e.time_range.end)
print(f"{a.shape}: wall {wall*1e3:.1f} ms (profiled), kernels {len(ev)}, GPU span {span/1e3:.1f} ms, busy {busy/1e3:.1f} ms, idle {(span-busy)/1e3:.1f} ms")
busy_by = collections.Counter(); cnt = collections.Counter()
for e in ev:
    busy_by[e.name[:60]] += e.time_range.end - e.time_range.start; cnt[e.name[:60]] += 1
print("busy by kernel (ms total, count):")
for name, us in busy_by.most_common(22):
    print(f"  {us/1e3:8.2f} ms {cnt[name]:6d}  {name}")
print("idle before (us total, count):")
for name, us in idle.most_common(12):
    print(f"  {us/1e3:8.2f} ms {n[name]:6d}  {name}")
print(f"gaps > 20 us: {len(big)}, {sum(g for g, _ in big)/1e3:.1f} ms; the largest:", sorted(big, reverse=True)[:8])
