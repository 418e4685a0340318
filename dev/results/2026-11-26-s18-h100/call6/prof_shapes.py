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
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
    for _ in range(2):
        step(b)
    torch.cuda.synchronize()
print("fp8" if fp8 else "bf16", "top kernels, 2 steps")
rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::") and e.key in ("aten::addmm", "aten::mm", "aten::addmm_", "aten::cat", "aten::copy_", "aten::linear")]
rows.sort(key=lambda e: -e.device_time_total)
for e in rows[:40]:
    print(f"{e.key:14s} {e.count:4d} calls {e.device_time_total/e.count:9.1f} us/call {e.device_time_total/2e3:8.2f} ms/step  {e.input_shapes}")
