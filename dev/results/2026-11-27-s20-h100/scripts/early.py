"""Where a dependent decoding kernel lets the next one launch: after its griddepcontrol.wait (the tree's) or before
it ("early", set from this script only, before anything compiles: at most three kernels in flight, the third
prefetching while the second waits). A GroupSampler's rollout (2 prompts x 8, 64 tokens), median of 9, per shape.
Run once per mode, in its own process."""
import argparse, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
import kernels.decode_linear as dl, kernels.decode_qkv as dq, kernels.decode_swiglu as ds, kernels.decode_attention as da

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc"); p.add_argument("--mode")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
if a.mode == "early":
    @triton.jit
    def _early(PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
    for m in (dl, dq, ds, da):
        m._after_previous = _early
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
dev = torch.device("cuda")
for shape in a.shapes.split(","):
    folder = model_folder(argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir))
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0, cuda_graph=True)
    g = torch.Generator(dev)
    for _ in range(3):
        g.manual_seed(0); out = s(prompts, 8, 0.0, generator=g)
    ts = []
    for _ in range(9):
        torch.cuda.synchronize(); t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    print(f"{shape} {a.mode}: rollout {sorted(ts)[4] * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}); greedy row 0 "
          f"{out[0][0][:6]}", flush=True)
