"""A graphed on+offload step with 0, 2 or 3 of the kept tensors (none; attention's output and lse; and o's output),
each mode a fresh model: `python3 keep_modes.py SHAPE BxT MODES REPEATS [nf4]`, e.g. tinyllama 4x2048 0,2,3 2.
Prints the median of 8 timed steps (after 3 warm-up) and the peak memory."""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench import SHAPES
from scripts.bench.bench_qlora import SHAPES as BIG, model_config
from model.config import from_hf_config

shape, size, modes, repeats = sys.argv[1], sys.argv[2], [int(m) for m in sys.argv[3].split(",")], int(sys.argv[4])
quantize = sys.argv[5] if len(sys.argv) > 5 else None
B, T = map(int, size.split("x"))
if shape in BIG:
    cfg = model_config(shape, False)
else:
    s = SHAPES[shape]
    cfg = from_hf_config({**s.sizes, "architectures": [s.config_class.replace("Config", "ForCausalLM")]}, shape)
dev = torch.device("cuda")
for r in range(repeats):
    for mode in modes:
        import model.transformer as mt
        mt.KEPT_FLOPS_PER_BYTE = 0 if mode >= 0 else 4000  # a forced mode: whatever the copies cost
        step = harness.nanotune_step(cfg, dev, "on+offload", quantize=quantize, cuda_graphs="on")
        model = step.model
        full = model.kept_tensors
        model.kept_tensors = lambda b, t, dtype, full=full, mode=mode: full(b, t, dtype)[:mode] if mode >= 0 else full(b, t, dtype)
        b = harness.fixed_batch(step.vocab_size, B, T, dev)
        for _ in range(3):
            step(b)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(8):
            t0 = time.perf_counter(); step(b); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(f"{shape} {size} mode {mode} run {r}: {ms:.2f} ms (min {min(times) * 1e3:.2f}), "
              f"{B * T / ms * 1e3 / 1e3:.1f}k tok/s, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
              f"kept {len(model.kept_tensors(B, T, torch.bfloat16))}", flush=True)
        del step, b, model, full
        import gc; gc.collect()
        torch.cuda.empty_cache()
