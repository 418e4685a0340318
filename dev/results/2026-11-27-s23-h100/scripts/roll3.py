"""roll.py with the look-ahead prefetch's experiment settings: --mode (model.decode.AHEAD_MODE) and --early
(kernels.decode_linear.AHEAD_EARLY)."""
import argparse, hashlib, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import kernels.decode_linear as dl
import model.decode as md
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
p.add_argument("--mode", type=int, default=0); p.add_argument("--early", action="store_true")
a = p.parse_args()
md.AHEAD_MODE, dl.AHEAD_EARLY = a.mode, a.early
dev = torch.device("cuda")
for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                     cuda_graph=True)
    g = torch.Generator(dev)
    for _ in range(3):
        g.manual_seed(0); out = s(prompts, 8, 0.0, generator=g)
    g.manual_seed(1); sampled = s(prompts, 8, 1.0, generator=g)
    ts = []
    for _ in range(9):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    h = hashlib.sha1(repr((out[0], sampled[0])).encode()).hexdigest()[:12]
    print(f"mode {a.mode}{'e' if a.early else ''} {shape}: rollout {sorted(ts)[4] * 1e3:.1f} ms "
          f"(min {min(ts) * 1e3:.1f}); tokens hash {h}", flush=True)
