"""Session 29: per-step times of the graphed Qwen2.5-7B NF4 step over 20 steps, with GC collections and GPU-side time."""
import gc, json, os, sys, time
root = sys.argv[1]
sys.path.insert(0, os.path.abspath(root))
from itertools import repeat
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config
dev = torch.device("cuda")
shape = os.environ.get("SHAPE", "qwen2.5-7b")
step = harness.nanotune_step(model_config(shape, False), dev, "off", quantize="nf4", fp8=False, cuda_graphs="on")
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
cols = []
gc.callbacks.append(lambda ph, info: cols.append((ph, info["generation"], time.perf_counter())))
for _ in range(2):
    step(b)
torch.cuda.synchronize()
rows = []
for i in range(int(os.environ.get("STEPS", 20))):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n0 = len(cols)
    torch.cuda.synchronize(); t = time.perf_counter(); e0.record()
    loss = step(b)
    e1.record(); torch.cuda.synchronize(); w = time.perf_counter() - t
    g = [(c[1]) for c in cols[n0:] if c[0] == "start"]
    rows.append((round(w * 1e3, 2), round(e0.elapsed_time(e1), 2), g))
    loss.item()
print(json.dumps({"shape": shape, "rows": rows}), flush=True)
