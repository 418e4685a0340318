"""The five-launch decoding layers with dependent launches under launch settings (run from a tree's root): WAVES
(kernels/decode_linear.py) and the column tile block_n of o / down (decode_linear) and of gate | up
(decode_swiglu), set from this script only. A GroupSampler's rollout (2 prompts x 8, 64 tokens, no stops), median
of 9 after 3 warm-ups; the current settings (1, 32, 32) measured between every three variants."""
import argparse, functools, itertools, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
import kernels.decode_linear as dl, kernels.decode_swiglu as ds, model.decode as md

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")


def setv(waves, bn_linear, bn_swiglu):
    dl.WAVES = waves
    md.decode_linear = functools.partial(dl.decode_linear, block_n=bn_linear)
    md.decode_swiglu = functools.partial(ds.decode_swiglu, block_n=bn_swiglu)


base = (1, 32, 32)
others = [v for v in itertools.product((1, 2), (16, 32, 64), (16, 32, 64)) if v != base]
order = []
for i in range(0, len(others), 3):
    order += [base] + others[i:i + 3]
order.append(base)
for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    ref = None
    for v in order:
        setv(*v)
        s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                         cuda_graph=True)
        g = torch.Generator(dev)
        for _ in range(3):
            g.manual_seed(0); out = s(prompts, 8, 0.0, generator=g)
        ts = []
        for _ in range(9):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        ref = ref or out[0]
        same = sum(x == y for x, y in zip(out[0], ref))
        print(f"{shape} waves {v[0]} block_n linear {v[1]} swiglu {v[2]}: rollout {sorted(ts)[4] * 1e3:.1f} ms "
              f"(min {min(ts) * 1e3:.1f}); greedy rows equal to the first: {same}/16", flush=True)
        del s
    setv(*base)
