"""Session 27 diagnostic: is a 2-D tiled GLU backward (features x tokens, layout (I, N)) slow because of its tiles or
because a program walks many of them? SwiGLU's in-place backward as 2-D tiles, each program L tiles along tokens,
optionally with dB's partial product (tile @ P, 16 wide) stored per program; against the 1-D kernel (kernels/swiglu.py)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from kernels.swiglu import swiglu_backward
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms


@triton.jit
def _bwd2d(dh_ptr, g_ptr, u_ptr, p_ptr, part_ptr, I, N, BF: tl.constexpr, BT: tl.constexpr, L: tl.constexpr,
           DOT: tl.constexpr):  # DOT 0: none, 1: tl.dot, 2: row-reductions
    rows = tl.program_id(0) * BF + tl.arange(0, BF)
    r = tl.arange(0, 16)
    acc = tl.zeros([BF, 16], dtype=tl.float32)
    for i in range(L):
        t = (tl.program_id(1) * L + i) * BT + tl.arange(0, BT)
        mask = (rows < I)[:, None] & (t < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + t[None, :]
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = (dh * u * s * (1.0 + g * (1.0 - s))).to(tl.bfloat16)
        du = (dh * g * s).to(tl.bfloat16)
        tl.store(g_ptr + offs, dg, mask=mask)
        tl.store(u_ptr + offs, du, mask=mask)
        if DOT == 1:
            p = tl.load(p_ptr + t.to(tl.int64)[:, None] * 16 + r[None, :], mask=(t < N)[:, None], other=0.0)
            acc += tl.dot(dg, p)
        if DOT == 2:  # 16 row-reductions of dG times P's column: no operand rearranged for the tensor cores
            dgf = dg.to(tl.float32)
            for rr in tl.static_range(16):
                pc = tl.load(p_ptr + t.to(tl.int64) * 16 + rr, mask=t < N, other=0.0).to(tl.float32)
                acc += tl.where(r[None, :] == rr, tl.sum(dgf * pc[None, :], axis=1)[:, None], 0.0)
    if DOT > 0:
        tl.store(part_ptr + (tl.program_id(1).to(tl.int64) * I + rows[:, None]) * 16 + r[None, :], acc,
                 mask=(rows < I)[:, None])


N = 4096
for name, I in (("qwen2.5-7b", 18944), ("llama-3.1-8b", 14336)):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(2 * I, N, **bf) * 0.1
    g, u = gu[:I], gu[I:]
    dh = torch.randn(I, N, **bf) * 0.1
    p = torch.randn(N, 16, **bf)
    t1 = median_ms(replayed(lambda: swiglu_backward(dh, g, u, inplace=True)), "cuda")
    print(f"{name}: 1-D in-place backward {t1 * 1e3:.1f} us ({5 * I * N * 2 / t1 / 1e9:.2f} TB/s)", flush=True)
    for BF, BT, W in ((8, 128, 4), (16, 128, 4), (32, 64, 4), (16, 64, 4), (8, 256, 4), (4, 256, 4), (32, 128, 8)):
        for L in (4, 16):
            for dot in (0, 2):
                part = torch.empty(triton.cdiv(N, BT * L), I, 16, device="cuda", dtype=torch.float32)
                grid = (triton.cdiv(I, BF), triton.cdiv(N, BT * L))
                fn = lambda: _bwd2d[grid](dh, g, u, p, part, I, N, BF=BF, BT=BT, L=L, DOT=dot, num_warps=W)
                t = median_ms(replayed(fn), "cuda")
                print(f"  tile {BF}x{BT} warps {W} L {L} dot {int(dot)}: {t * 1e3:.1f} us ({5 * I * N * 2 / t / 1e9:.2f} TB/s; "
                      f"partials {part.numel() * 4 / 2**20:.0f} MiB)", flush=True)
