"""Session 31: bench_grpo.py's loop with its rollout split (synced): the sampler call, model.eval()+train(), the
texts, the rewards and the rest of roll_out; medians over the timed steps. Args after -- go to bench_grpo.py."""
import importlib, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
b = importlib.import_module("scripts.bench.bench_grpo")
gen = importlib.import_module("model.generate")
rollout = importlib.import_module("rollout")
rec = {}
def timed(owner, name, label, sync=True):
    f = getattr(owner, name)
    def g(*a, **k):
        if sync: torch.cuda.synchronize()
        t0 = time.perf_counter(); r = f(*a, **k)
        if sync: torch.cuda.synchronize()
        rec.setdefault(label, []).append(time.perf_counter() - t0); return r
    setattr(owner, name, g)
timed(gen.GroupSampler, "__call__", "sampler call")
def completions(sampler, prompts, cfg, tokenizer, stops, G, generator=None, temperature=None):
    t = [time.perf_counter()]
    sampler.model.eval(); t.append(time.perf_counter())
    ids, logps = sampler([p.ids for p in prompts], G, cfg.temperature if temperature is None else temperature,
                         cfg.top_p, cfg.top_k, stop_ids=stops, generator=generator); t.append(time.perf_counter())
    sampler.model.train(); t.append(time.perf_counter())
    texts = [tokenizer.decode(c[:-1] if c and c[-1] in stops else c) for c in ids]; t.append(time.perf_counter())
    for label, a, b_ in zip(["eval()", "call+syncs", "train()", "texts"], t, t[1:]):
        rec.setdefault(label, []).append(b_ - a)
    return ids, logps, texts
rollout.completions = completions
timed(rollout.rewards, "score", "rewards.score", sync=False)
timed(b, "roll_out", "roll_out")
timed(b, "collate", "collate", sync=False)
sys.argv = ["bench_grpo.py"] + sys.argv[1:]
b.main()
for k, v in rec.items():
    v = v[3:]
    print(f"  {k}: median {statistics.median(v) * 1e3:.2f} ms, min {min(v) * 1e3:.2f} (n={len(v)})")
