"""Where the decoding SwiGLU GEMM (norm prologue, gate | up pair, SwiGLU epilogue) loses to a plain GEMM of the
same bytes: variants of it, each in one CUDA graph of L launches over L distinct weights (cold L2)."""
import itertools
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl

from kernels.decode_linear import Workspace, _after_previous, _prefetch_rows, _rstd, dot_constexprs, launch_config
from kernels.decode_swiglu import _decode_swiglu_kernel, decode_swiglu
from kernels.rms_norm import _normalized


@triton.jit
def swi(x_ptr, nw_ptr, w_ptr, h_ptr, M, N, K, eps,
        NORM: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        _prefetch_rows(w_ptr, cols, cols < N, K, 0, K, BLOCK_K)
        _prefetch_rows(w_ptr, N + cols, cols < N, K, 0, K, BLOCK_K)
    _after_previous(PDL)
    if NORM == 1:
        rstd = _rstd(x_ptr, rows, M, K, eps, BLOCK_M, BLOCK_K)
    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xm = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=xm, other=0.0)
        if NORM == 1:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = _normalized(x.to(tl.float32), nw[None, :], rstd[:, None], 0.0, x_ptr, nw_ptr, False).to(
                x_ptr.dtype.element_ty)
        if NORM == 2:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * nw[None, :]).to(x_ptr.dtype.element_ty)
        wm = (cols[:, None] < N) & (ks[None, :] < K)
        w1 = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=wm, other=0.0)
        w2 = tl.load(w_ptr + (N + cols[:, None]) * K + ks[None, :], mask=wm, other=0.0)
        if SWAP:
            acc_g = tl.dot(w1, tl.trans(x), acc_g)
            acc_u = tl.dot(w2, tl.trans(x), acc_u)
        else:
            acc_g = tl.dot(x, tl.trans(w1), acc_g)
            acc_u = tl.dot(x, tl.trans(w2), acc_u)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if NORM == 2:
        ssq = tl.zeros([BLOCK_M], tl.float32)
        rs = _rstd(x_ptr, rows, M, K, eps, BLOCK_M, BLOCK_K)
        acc_g = acc_g * rs[:, None]
        acc_u = acc_u * rs[:, None]
    g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def timed(fns, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    return min(best)


SHAPES = {"qwen": (4864, 896, 24), "smol": (1536, 576, 30)}
torch.manual_seed(0)
for name, (N, K, L) in SHAPES.items():
    xs = [torch.randn(16, K, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    ws = [torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(L)]
    nw = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    mb = 2 * N * K * 2 / 1e6
    wsp = Workspace()
    hs = [decode_swiglu(x, nw, w, None, wsp, eps=1e-6) for x, w in zip(xs, ws)]
    res = [(timed([lambda x=x, w=w: decode_swiglu(x, nw, w, None, wsp, eps=1e-6) for x, w in zip(xs, ws)]),
            "tree, PDL")]

    def tree_nopdl(x, w, h):
        tiles = triton.cdiv(N, 32)
        split, chunk, block_k = launch_config(tiles, K, x)
        _decode_swiglu_kernel[(tiles, split)](x, nw, w, w, h, wsp.partials, wsp.counts, 16, N, K, chunk, 1e-6, 0.0,
                                              GEMMA_CAST=False, HAS_BIAS=False, SPLIT=split, **dot_constexprs(x),
                                              BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, PDL=False, launch_pdl=False,
                                              num_warps=4, num_stages=4)
    outs = [torch.empty_like(h) for h in hs]
    res.append((timed([lambda x=x, w=w, h=h: tree_nopdl(x, w, h) for x, w, h in zip(xs, ws, outs)]), "tree, no PDL"))
    for norm, swap, bn, pdl, stages in itertools.product((0, 1, 2), (0, 1), (32, 64), (0, 1), (3, 4)):
        if swap and bn < 64:
            continue
        outs = [torch.empty_like(h) for h in hs]

        def fn(x, w, h, norm=norm, swap=swap, bn=bn, pdl=pdl, stages=stages):
            swi[(triton.cdiv(N, bn),)](x, nw, w, h, 16, N, K, 1e-6, NORM=norm, SWAP=bool(swap), PDL=bool(pdl),
                                       PREFETCH=bool(pdl), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, launch_pdl=bool(pdl),
                                       num_warps=4, num_stages=stages)
        try:
            t = timed([lambda x=x, w=w, h=h: fn(x, w, h) for x, w, h in zip(xs, ws, outs)])
            err = max(float((o.float() - h.float()).abs().max()) for o, h in zip(outs[:3], hs[:3]))
            res.append((t, f"norm {norm} swap {swap} bn {bn} pdl {pdl} stages {stages}: max diff from tree {err:.4f}"))
        except Exception as e:
            res.append((1e9, f"norm {norm} swap {swap} bn {bn} pdl {pdl}: {type(e).__name__} {str(e)[:150]}"))
    res.sort()
    print(f"== {name}: gate|up N {2 * N} K {K}, {mb:.2f} MB a weight, {L} weights", flush=True)
    for t, what in res:
        print(f"  {t:7.2f} us  {mb / t:5.2f} TB/s  {what}")
