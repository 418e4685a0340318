"""Session 27: one NF4 2x2048 case of one tree, graphed: SHAPE=... python ab2.py ROOT PREC:CKPT -> one JSON line."""
import json, os, sys
root, case = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.abspath(root))
from itertools import repeat
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config
prec, ckpt = case.split(":")
dev = torch.device("cuda")
shape = os.environ.get("SHAPE", "llama-3.1-8b")
step = harness.nanotune_step(model_config(shape, False), dev, ckpt, quantize="nf4", fp8=prec == "fp8", cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
r = harness.time_steps(step, repeat(b), warmup=2, steps=int(os.environ.get("STEPS", 5)), device=dev)
print(json.dumps({"tree": root, "shape": shape, "case": case, "ms": round(r["median_step_s"] * 1e3, 2),
                  "min_ms": round(min(r["step_times_s"]) * 1e3, 2), "peak_gib": round(r["peak_mem_bytes"] / 2**30, 3),
                  "loss_final": r["loss_final"], "device": torch.cuda.get_device_name()}), flush=True)
