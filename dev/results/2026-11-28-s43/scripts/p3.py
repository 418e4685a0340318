"""Which aten ops launch the small kernels of a Llama-3.1-8B NF4 exact bf16 ckpt-off step (2 x 2048, eager, so that
the profiler ties each kernel to its op): device time by op and input shapes, GEMMs and attention left out."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

dev = torch.device("cuda")
step = harness.nanotune_step(model_config(os.environ.get("SHAPE", "llama-3.1-8b"), False), dev, "off", quantize="nf4")
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
for _ in range(2):
    step(b)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                            record_shapes=True) as prof:
    step(b)
    torch.cuda.synchronize()
skip = ("mm", "addmm", "addmm_", "_scaled_dot_product", "_efficient", "_cudnn", "_flash", "linear", "matmul", "baddbmm")
rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
rows.sort(key=lambda e: -e.self_device_time_total)
for e in rows[:60]:
    print(f"{e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:48]:48s} {str(e.input_shapes)[:150]}")
