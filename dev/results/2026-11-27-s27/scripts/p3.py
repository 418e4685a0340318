"""Session 27: an eager Qwen2.5-7B NF4 2x2048 bf16 ckpt-off step under torch.profiler with shapes: CUDA time by op and input shapes."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config
dev = torch.device("cuda")
step = harness.nanotune_step(model_config(os.environ.get("SHAPE", "qwen2.5-7b"), False), dev, "off", quantize="nf4")
b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
for _ in range(2):
    step(b)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                            record_shapes=True) as prof:
    step(b); torch.cuda.synchronize()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=70, max_name_column_width=40,
                                                          max_shapes_column_width=110))
