"""Profile the Llama-3.1-8B NF4 step (2x2048, ckpt off, eager) with and without --fp8: top CUDA kernels."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

fp8 = sys.argv[1] == "fp8"
dev = torch.device("cuda")
step = harness.nanotune_step(model_config("llama-3.1-8b", False), dev, "off", quantize="nf4", fp8=fp8)
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
for _ in range(3):
    step(b)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step(b)
    torch.cuda.synchronize()
print("fp8" if fp8 else "bf16", "top kernels, 2 steps")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90))
