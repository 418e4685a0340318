"""What each of a decoding layer's five launches costs inside a rollout: a GroupSampler rollout (2 prompts x 8, 64
tokens, no stops, median of 9) with one kind of launch left out (its output a fixed tensor of the right shape,
made once; the tokens are then meaningless, the times not), each variant captured anew. "no layers": the layers
all left out (the embedding, final norm, LM head, sampler and the eager ops around the graph stay)."""
import argparse, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
import model.decode as md

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")
real = dict(qkv=md.decode_qkv, lin=md.decode_linear, swi=md.decode_swiglu, call=md.FusedDecode.__call__)
fixed = {}


def stub(key, shape, dtype):
    if key not in fixed:
        fixed[key] = torch.zeros(shape, device=dev, dtype=dtype)
    return fixed[key]


for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, mcfg = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    I = mcfg.intermediate_size if hasattr(mcfg, "intermediate_size") else None
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    real_attn = model.ops.decode_attention
    for r in (1, 2):
        for variant in ("full", "no q|k|v", "no attention", "no o", "no gate|up", "no down", "no layers"):
            fixed.clear()
            md.decode_qkv, md.decode_linear, md.decode_swiglu = real["qkv"], real["lin"], real["swi"]
            md.FusedDecode.__call__ = real["call"]
            model.ops.decode_attention = real_attn
            if variant == "no q|k|v":
                md.decode_qkv = lambda x, nw, w, b, cos, sin, k, v, at, nh, ws, **kw: stub(
                    "q", (x.shape[0], nh, k.shape[-1]), x.dtype)
            elif variant == "no attention":
                model.ops.decode_attention = lambda q, *args: stub("y", q.shape, q.dtype)
            elif variant in ("no o", "no down"):
                def lin(x, w, b, r, ws, _v=variant):
                    is_down = w.shape[1] != w.shape[0] and w.shape[1] > r.shape[1] * 2
                    if (_v == "no down") == is_down:
                        return r
                    return real["lin"](x, w, b, r, ws)
                md.decode_linear = lin
            elif variant == "no gate|up":
                md.decode_swiglu = lambda x, nw, w, b, ws, **kw: stub("h", (x.shape[0], w.shape[0] // 2), x.dtype)
            elif variant == "no layers":
                md.FusedDecode.__call__ = lambda self, model, x, tables, masks, cache: model.model.norm(x)
            s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                             cuda_graph=True)
            g = torch.Generator(dev).manual_seed(0)
            for _ in range(3):
                s(prompts, 8, 1.0, generator=g)
            ts = []
            for _ in range(9):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            print(f"{r} {shape} {variant}: rollout {sorted(ts)[4] * 1e3:.1f} ms (min {min(ts) * 1e3:.1f})", flush=True)
            del s
