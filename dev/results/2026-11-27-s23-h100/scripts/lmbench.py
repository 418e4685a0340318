"""The LM head of a decoding step at Qwen2.5-0.5B's shape (16 rows x 896 -> 151936, bf16): F.linear (cuBLAS) against
the decoding GEMM kernel (kernels/decode_linear.py, a zero residual) at several column tiles, each launch in a CUDA
graph of 8 replays; median µs a launch and TB/s of the weight."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from kernels.decode_linear import Workspace, decode_linear
dev = torch.device("cuda")
V, H, M = 151936, 896, 16
w = torch.randn(V, H, device=dev, dtype=torch.bfloat16)
x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
zero = torch.zeros(M, V, device=dev, dtype=torch.bfloat16)
ws = Workspace()


def timed(fn, n=8):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(ts)


ref = F.linear(x, w).float()
us = timed(lambda: F.linear(x, w))
print(f"F.linear: {us:.1f} us, {w.numel() * 2 / us / 1e6:.2f} TB/s", flush=True)
for bn in (32, 64, 128):
    y = decode_linear(x, w, None, zero, ws, block_n=bn)
    d = (y.float() - ref).abs().max().item()
    us = timed(lambda: decode_linear(x, w, None, zero, ws, block_n=bn))
    print(f"decode_linear block_n {bn}: {us:.1f} us, {w.numel() * 2 / us / 1e6:.2f} TB/s, max diff {d:.3g}", flush=True)
