"""Where a GRPO rollout's wall time goes: the sampler's call, entering MergedAdapters, the prefill, the decoding
graph's replays alone, sample_tokens alone. Run from a tree's root: python3 rollout_parts.py --shape S --tokenizer T."""
import argparse, statistics, sys, time, os
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler, sample_tokens
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--shape"); p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
a = p.parse_args(); a.model = None; a.smoke = False
dev = torch.device("cuda")
folder = model_folder(a)
tok = load_tokenizer(a.tokenizer)
cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64, beta=None,
                                         loss_type="dapo", num_iterations=1), "cuda")
model, mcfg = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
prompts = [q.ids for q in make_prompts(tok, 2)]
N = 64
s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=N, pad_id=0, cuda_graph=True)
g = torch.Generator(dev).manual_seed(0)

def timed(fn, n=7):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); out.append(time.perf_counter() - t)
    return statistics.median(out[2:]) * 1e3

print(f"{a.shape}: prompt lens {list(map(len, prompts))}, {len(s.merged.views)} merged views")
print(f"sampler call, {N} tokens: {timed(lambda: s(prompts, 8, 1.0, generator=g)):.1f} ms")
s1 = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=1, pad_id=0, cuda_graph=True)
print(f"sampler call, 1 token (merge, prefill, cache copies, one sample): {timed(lambda: s1(prompts, 8, 1.0, generator=g)):.1f} ms")
with s.merged:
    M0 = s.max_prompt_len
    ids = torch.zeros(2, M0, dtype=torch.long, device=dev); sl = torch.arange(M0, device=dev)
    from model.generate import KVCache
    def prefill():
        c = KVCache(model.config, 2, M0, torch.bfloat16, dev)
        h = model.hidden_states(ids, sl[None].expand(2, -1), torch.ones_like(ids), cache=c)[:, -1]
        model.logits(h)
    print(f"prefill alone (2 x {M0}): {timed(prefill):.1f} ms")
def enter_exit():
    s.merged.__enter__(); s.merged.__exit__(None, None, None)
print(f"MergedAdapters enter+exit: {timed(enter_exit):.2f} ms")
M = s.max_prompt_len
with s.merged:
    tokens = torch.zeros(16, dtype=torch.long, device=dev); pos = torch.full((16,), 40, device=dev)
    def replays():
        for t in range(N):
            s.decode(tokens, M + t, pos + t)
    print(f"{N} graph replays alone: {timed(replays):.1f} ms")
    logits = torch.randn(16, model.config.vocab_size, device=dev, dtype=torch.bfloat16)
    def samples():
        for t in range(N):
            sample_tokens(logits, 1.0, 1.0, 0, g)
    print(f"{N} sample_tokens alone: {timed(samples):.1f} ms")
    kern = getattr(model.ops, "sample_tokens", None)
    if kern is not None:
        def ksamples():
            for t in range(N):
                sample_tokens(logits, 1.0, 1.0, 0, g, kern)
        print(f"{N} sample_tokens alone, kernels: {timed(ksamples):.1f} ms")
    def both():
        for t in range(N):
            lg = s.decode(tokens, M + t, pos + t)
            sample_tokens(lg, 1.0, 1.0, 0, g)
    print(f"{N} replays + sample_tokens: {timed(both):.1f} ms")
