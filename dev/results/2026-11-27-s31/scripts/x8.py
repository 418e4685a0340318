"""Session 31: the five-launch decoding GEMMs at Llama-3.1-8B's shapes (16 rows, bf16): each launch alone, timed
over 200 launches (CUDA events; the weights, 50-470 MB, do not stay in L2), as the tree configures it and with
decode_linear's WAVES and NUM_STAGES patched; achieved TB/s of the weights' bytes. Also Qwen2.5-0.5B's for scale."""
import os, sys, itertools
sys.path.insert(0, os.getcwd())
import torch
import kernels.decode_linear as dl
from kernels.decode_linear import Workspace, decode_linear
from kernels.decode_swiglu import decode_swiglu
from kernels.decode_qkv import decode_qkv

dev, dt, M = "cuda", torch.bfloat16, 16
SHAPES = {"llama-3.1-8b": (4096, 14336, 32, 8, 128), "qwen2.5-0.5b": (896, 4864, 14, 2, 64)}


def timed(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3  # us


for shape, (H, I, Hq, Hk, D) in SHAPES.items():
    ws = Workspace()
    x = torch.randn(M, H, device=dev, dtype=dt)
    nw = torch.ones(H, device=dev, dtype=dt)
    w_qkv = torch.randn((Hq + 2 * Hk) * D, H, device=dev, dtype=dt) * 0.02
    w_o = torch.randn(H, Hq * D, device=dev, dtype=dt) * 0.02
    w_gu = torch.randn(2 * I, H, device=dev, dtype=dt) * 0.02
    w_d = torch.randn(H, I, device=dev, dtype=dt) * 0.02
    y = torch.randn(M, Hq * D, device=dev, dtype=dt)
    h = torch.randn(M, I, device=dev, dtype=dt)
    cos = torch.ones(M, D, device=dev, dtype=dt); sin = torch.zeros(M, D, device=dev, dtype=dt)
    kc = torch.zeros(M, Hk, 128, D, device=dev, dtype=dt); vc = torch.zeros_like(kc)
    at = torch.tensor([5], device=dev)
    bn = [32]
    launches = {"qkv": (lambda: decode_qkv(x, nw, w_qkv, None, cos, sin, kc, vc, at, Hq, ws), w_qkv),
                "o": (lambda: decode_linear(y, w_o, None, x, ws, block_n=bn[0]), w_o),
                "gate|up": (lambda: decode_swiglu(x, nw, w_gu, None, ws, block_n=bn[0]), w_gu),
                "down": (lambda: decode_linear(h, w_d, None, x, ws, block_n=bn[0]), w_d)}
    for block_n, waves, stages in itertools.product((32, 64), (1, 2, 3), (3, 4, 6)):
        if block_n == 64 and stages == 6:
            continue
        bn[0], dl.WAVES, dl.NUM_STAGES = block_n, waves, stages
        row = []
        for name, (fn, w) in launches.items():
            us = timed(fn)
            row.append(f"{name} {us:6.1f} us {w.numel() * 2 / us / 1e6:4.2f} TB/s")
        print(f"{shape} BLOCK_N {block_n} WAVES {waves} STAGES {stages}: " + "; ".join(row), flush=True)
