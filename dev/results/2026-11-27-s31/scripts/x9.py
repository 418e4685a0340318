"""Session 31: decode_swiglu and decode_linear at 16 rows, bf16, BLOCK_N 32 against 64, each timed as a CUDA graph of
20 launches (replayed 20 times, CUDA events; the GPU's time a launch, with the dependent launches' overlap), at the
shapes (hidden, intermediate) of several models."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from kernels.decode_linear import Workspace, decode_linear
from kernels.decode_swiglu import decode_swiglu

dev, dt, M = "cuda", torch.bfloat16, 16
SHAPES = {"llama-3.1-8b": (4096, 14336), "qwen2.5-7b": (3584, 18944), "tinyllama": (2048, 5632),
          "qwen2.5-0.5b": (896, 4864), "qwen3-0.6b": (1024, 3072), "smollm2-135m": (576, 1536)}


def graphed_us(fn, n=20, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / (n * reps) * 1e3


for shape, (H, I) in SHAPES.items():
    ws = Workspace()
    x = torch.randn(M, H, device=dev, dtype=dt); nw = torch.ones(H, device=dev, dtype=dt)
    w_gu = torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02
    w_d = torch.randn(H, I, device=dev, dtype=dt) * 0.02
    h = torch.randn(M, I, device=dev, dtype=dt)
    w_o = torch.randn(H, H, device=dev, dtype=dt) * 0.02
    row = []
    for bn in (32, 64):
        gu = graphed_us(lambda: decode_swiglu(x, nw, w_gu, None, ws, block_n=bn))
        dn = graphed_us(lambda: decode_linear(h, w_d, None, x, ws, block_n=bn))
        o = graphed_us(lambda: decode_linear(x, w_o, None, x, ws, block_n=bn))
        row.append(f"BLOCK_N {bn}: gate|up {gu:6.1f} us ({w_gu.numel() * 2 / gu / 1e6:4.2f} TB/s), down {dn:6.1f} us "
                   f"({w_d.numel() * 2 / dn / 1e6:4.2f} TB/s), o (H x H) {o:5.1f} us")
    print(f"{shape}: " + "; ".join(row), flush=True)
