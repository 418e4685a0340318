"""Llama-3.1-8B NF4 at 1 x 131072, checkpointing + offload, graphed as bench_qlora: the first and second step's
times, with the attention outputs kept (the tree) or recomputed (room_for answering no), each in its own process."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

keep = sys.argv[1] == "keep"
dev = torch.device("cuda")
step = harness.nanotune_step(model_config("llama-3.1-8b", False), dev, "on+offload", quantize="nf4", cuda_graphs="on")
if not keep:
    step.model.offload.room_for = lambda nbytes: False
b = harness.fixed_batch(step.vocab_size, 1, 131072, dev)
for i in range(2):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    step(b); torch.cuda.synchronize()
    print(f"{sys.argv[1]} step {i + 1}: {time.perf_counter() - t0:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB",
          flush=True)
