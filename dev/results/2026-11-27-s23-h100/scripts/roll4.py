"""roll.py with q | k | v's and o's split of K forced (--split-qkv N, --split-o N; 0: the tree's launch_config),
by replacing launch_config in the kernels' modules (an experiment: the launches' values change by the sums' order)."""
import argparse, hashlib, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, triton
import kernels.decode_linear as dl
import kernels.decode_qkv as dq
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
p.add_argument("--split-qkv", type=int, default=0); p.add_argument("--split-o", type=int, default=0)
a = p.parse_args()
orig = dl.launch_config


def forced(n, only_small=False):
    def config(tiles, K, x):
        split, chunk, bk = orig(tiles, K, x)
        if n == 0 or (only_small and K > 1024):
            return split, chunk, bk
        blocks = triton.cdiv(K, bk)
        chunk = triton.cdiv(blocks, min(n, blocks)) * bk
        return triton.cdiv(K, chunk), chunk, bk
    return config


dq.launch_config = forced(a.split_qkv)
dl.launch_config = forced(a.split_o, only_small=True)
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
    print(f"qkv {a.split_qkv} o {a.split_o} {shape}: rollout {sorted(ts)[4] * 1e3:.1f} ms "
          f"(min {min(ts) * 1e3:.1f}); tokens hash {h}", flush=True)
