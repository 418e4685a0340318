"""Session 40: one graphed step case of one tree: python ab4.py ROOT SHAPE BxT CKPT [nf4] -> one JSON line
(WARM, STEPS from the environment). SHAPE: a bench_qlora shape (in memory, random NF4) or a bench.py shape."""
import json, os, sys
root, shape, size, ckpt = sys.argv[1:5]
quantize = sys.argv[5] if len(sys.argv) > 5 else None
sys.path.insert(0, os.path.abspath(root))
from itertools import repeat
import torch
from scripts.bench import harness
from scripts.bench.bench import SHAPES
from scripts.bench.bench_qlora import SHAPES as BIG, model_config
from model.config import from_hf_config
B, T = map(int, size.split("x"))
if shape in BIG:
    cfg = model_config(shape, False)
else:
    s = SHAPES[shape]
    cfg = from_hf_config({**s.sizes, "architectures": [s.config_class.replace("Config", "ForCausalLM")]}, shape)
dev = torch.device("cuda")
step = harness.nanotune_step(cfg, dev, ckpt, quantize=quantize, cuda_graphs="on")
kept = len(step.model.kept_tensors(B, T, torch.bfloat16)) if ckpt == "on+offload" else 0
b = harness.fixed_batch(step.vocab_size, B, T, dev)
r = harness.time_steps(step, repeat(b), warmup=int(os.environ.get("WARM", 3)), steps=int(os.environ.get("STEPS", 8)),
                       device=dev)
print(json.dumps({"tree": root, "shape": shape, "size": size, "ckpt": ckpt, "kept": kept,
                  "ms": round(r["median_step_s"] * 1e3, 2), "min_ms": round(min(r["step_times_s"]) * 1e3, 2),
                  "peak_gib": round(r["peak_mem_bytes"] / 2**30, 3), "loss_final": r["loss_final"]}), flush=True)
