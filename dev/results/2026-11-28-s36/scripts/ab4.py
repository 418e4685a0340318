"""Session 36: ab3.py with kernels.glu.MIN_TERM_ELEMENTS set from MTE (a measurement of the threshold, not a switch
of the product): SHAPE=smollm2-135m CKPT=off MTE=4194304 python ab4.py ROOT -> one JSON line."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, os.path.abspath(root))
from itertools import repeat
import torch
import kernels.glu
kernels.glu.MIN_TERM_ELEMENTS = int(os.environ.get("MTE", kernels.glu.MIN_TERM_ELEMENTS))
from scripts.bench import harness
from scripts.bench.bench import SHAPES
from model.config import from_hf_config
dev = torch.device("cuda")
shape, ckpt = os.environ.get("SHAPE", "smollm2-135m"), os.environ.get("CKPT", "off")
s = SHAPES[shape]
arch = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM", "Gemma2Config": "Gemma2ForCausalLM"}[s.config_class]
cfg = from_hf_config(dict(architectures=[arch], **s.sizes), shape)
step = harness.nanotune_step(cfg, dev, ckpt, cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, s.batch, s.seqlen, dev)
r = harness.time_steps(step, repeat(b), warmup=3, steps=int(os.environ.get("STEPS", 20)), device=dev)
print(json.dumps({"mte": kernels.glu.MIN_TERM_ELEMENTS, "shape": shape, "ckpt": ckpt, "ms": round(r["median_step_s"] * 1e3, 3),
                  "min_ms": round(min(r["step_times_s"]) * 1e3, 3), "peak_gib": round(r["peak_mem_bytes"] / 2**30, 3),
                  "loss_final": r["loss_final"], "device": torch.cuda.get_device_name()}), flush=True)
