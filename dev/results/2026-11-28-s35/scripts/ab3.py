"""Session 28: one small-model case of one tree, graphed, bf16 LoRA on full-precision weights (bench.py's shapes):
SHAPE=qwen2.5-0.5b CKPT=off STEPS=10 python ab3.py ROOT -> one JSON line."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, os.path.abspath(root))
from itertools import repeat
import torch
from scripts.bench import harness
from scripts.bench.bench import SHAPES
from model.config import from_hf_config
dev = torch.device("cuda")
shape, ckpt = os.environ.get("SHAPE", "qwen2.5-0.5b"), os.environ.get("CKPT", "off")
s = SHAPES[shape]
arch = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM", "Gemma2Config": "Gemma2ForCausalLM"}[s.config_class]
cfg = from_hf_config(dict(architectures=[arch], **s.sizes), shape)
step = harness.nanotune_step(cfg, dev, ckpt, cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, s.batch, s.seqlen, dev)
r = harness.time_steps(step, repeat(b), warmup=3, steps=int(os.environ.get("STEPS", 10)), device=dev)
print(json.dumps({"tree": root, "shape": shape, "ckpt": ckpt, "ms": round(r["median_step_s"] * 1e3, 3),
                  "min_ms": round(min(r["step_times_s"]) * 1e3, 3), "peak_gib": round(r["peak_mem_bytes"] / 2**30, 3),
                  "loss_final": r["loss_final"], "device": torch.cuda.get_device_name()}), flush=True)
