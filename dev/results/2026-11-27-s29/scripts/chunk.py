"""Session 29: the fused loss's chunk rows at 7-9B: SHAPE=... ROWS=N python chunk.py PREC:CKPT -> one JSON line."""
import json, os, sys
sys.path.insert(0, os.getcwd())
from itertools import repeat
import torch
import kernels.fused_linear_cross_entropy as flce
flce.MIN_CHUNK_ROWS = int(os.environ["ROWS"])
flce.MAX_CHUNK_BYTES = max(flce.MAX_CHUNK_BYTES, flce.MIN_CHUNK_ROWS * 152064 * 2)
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config
prec, ckpt = sys.argv[1].split(":")
dev = torch.device("cuda")
shape = os.environ.get("SHAPE", "qwen2.5-7b")
step = harness.nanotune_step(model_config(shape, False), dev, ckpt, quantize="nf4", fp8=prec == "fp8", cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
r = harness.time_steps(step, repeat(b), warmup=2, steps=int(os.environ.get("STEPS", 10)), device=dev)
print(json.dumps({"shape": shape, "rows": flce.MIN_CHUNK_ROWS, "case": sys.argv[1], "ms": round(r["median_step_s"] * 1e3, 2),
                  "mean_ms": round(sum(r["step_times_s"]) / len(r["step_times_s"]) * 1e3, 2),
                  "peak_gib": round(r["peak_mem_bytes"] / 2**30, 3)}), flush=True)
