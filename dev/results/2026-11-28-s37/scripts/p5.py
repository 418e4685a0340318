"""Session 35: eager NF4 step (2 x 2048, ckpt off) under torch.profiler with shapes: each kernel's time attributed to the aten op
that launched it and that op's input shapes, top lines per step. Usage: SHAPE=... python3 .gpu/p4.py fp8|bf16 [...]"""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

dev = torch.device("cuda")
for prec in sys.argv[1:]:
    step = harness.nanotune_step(model_config(os.environ.get("SHAPE", "llama-3.1-8b"), False), dev, "off",
                                 quantize="nf4", fp8=prec == "fp8", cuda_graphs="off")
    b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
    for _ in range(3):
        step(b)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        step(b)
        torch.cuda.synchronize()
    rows = {}
    total = 0.0
    for e in prof.events():
        if not e.kernels:
            continue
        for k in e.kernels:
            key = (e.name, str(e.input_shapes)[:110], k.name[:70])
            n, d = rows.get(key, (0, 0.0))
            rows[key] = (n + 1, d + k.duration)
            total += k.duration
    print(f"== {os.environ.get('SHAPE', 'llama-3.1-8b')} {prec}: kernels attributed {total / 1e3:.1f} ms", flush=True)
    for (op, shapes, kern), (n, d) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:int(os.environ.get("TOP", 45))]:
        print(f"  {d / 1e3:7.2f} ms {n:4d}x  {op:28s} {kern:70s} {shapes}")
    del step, b
    torch.cuda.empty_cache()
