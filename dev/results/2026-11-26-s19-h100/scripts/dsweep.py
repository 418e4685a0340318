"""The five-launch decoding layers (model/decode.py, run from the tree in the current directory) under launch
configurations, against the nine-launch path: a GroupSampler's rollout (2 prompts x 8, 64 tokens, no stops), median
of 7 after 3 warm-ups, per shape. Variants set kernels/decode_*.py's module constants (this script only)."""
import argparse, functools, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, triton
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
import kernels.decode_linear as dl, kernels.decode_qkv as dq, kernels.decode_swiglu as ds, model.decode as md

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")


def setv(waves=2, stages=3, warps=4):
    for m in (dl, dq, ds):
        m.NUM_WARPS, m.NUM_STAGES = warps, stages
    dl.WAVES = waves


VARIANTS = {"nine": None, **{f"waves{w}-s{s}-w{n}": dict(waves=w, stages=s, warps=n)
                             for w in (2, 3, 4, 1) for n in (2, 4) for s in (3, 4)}}
for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    fused = model.ops.fused_decode
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    ref = None
    for name, v in list(VARIANTS.items()) + [("nine", None)]:
        model.ops.fused_decode = None if v is None else fused
        if v is not None:
            setv(**v)
        s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                         cuda_graph=True)
        g = torch.Generator(dev)
        for _ in range(3):
            g.manual_seed(0); out = s(prompts, 8, 0.0, generator=g)
        ts = []
        for _ in range(7):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        same = "" if ref is None else f", greedy tokens equal to nine's: {sum(x == y for x, y in zip(out[0], ref))}/16"
        if name == "nine" and ref is None:
            ref = out[0]
        print(f"{shape} {name}: rollout {sorted(ts)[3] * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}){same}", flush=True)
        del s
