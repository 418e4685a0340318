"""Next session: torch._scaled_mm with and without use_fast_accum on Llama-3.1-8B's fp8 GEMM shapes (2 x 2048 tokens):
time (CUDA-graph replays) and each result's error against fp64 on the same e4m3 operands."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from kernels.fp8_quantize import fp8_quantize_rows
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms

M = 4096
SHAPES = {"q|k|v fwd": (6144, 4096), "o fwd": (4096, 4096), "gate|up fwd": (28672, 4096), "down fwd": (4096, 14336),
          "q|k|v dX": (4096, 6144), "o dX": (4096, 4096), "gate|up dX": (4096, 28672), "down dX": (14336, 4096)}
g = torch.Generator(device="cuda").manual_seed(0)
for name, (n, k) in SHAPES.items():
    x = torch.randn(M, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    a, sa = fp8_quantize_rows(x)
    b, sb = fp8_quantize_rows(w)
    exact = (a.double() * sa[:, None].double()) @ (b.double() * sb[:, None].double()).t()
    row = [name]
    for fast in (False, True):
        fn = lambda: torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16,
                                      use_fast_accum=fast)
        y = fn()
        err = ((y.double() - exact).norm() / exact.norm()).item()
        ms = median_ms(replayed(fn), "cuda")
        row.append(f"fast={fast}: {ms * 1e3:.1f} us, {2 * M * n * k / ms / 1e9:.0f} TFLOP/s, rel err {err:.2e}")
    print(" | ".join(row), flush=True)
