"""Session 35: the SwiGLU backward with the adapters' terms (dh's, gate's, up's) as a loop over row tiles with each
term's R kept (standalone), against the tree's tile kernel and the plain 1-d backward; more forward loop shapes."""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
from t1 import k_loop, timeit  # noqa: E402
from kernels.swiglu import swiglu_backward, swiglu_forward  # noqa: E402

dev, bf = torch.device("cuda"), torch.bfloat16


@triton.jit
def k_loop_bwd(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, lh_ptr, lg_ptr, lu_ptr, rh_ptr, rg_ptr, ru_ptr,
               n_rows, n_cols, LHS: tl.constexpr, RHS: tl.constexpr, LS: tl.constexpr, RS: tl.constexpr,
               K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
    col_tiles = tl.cdiv(n_cols, BC)
    cols = (tl.program_id(0) % col_tiles) * BC + tl.arange(0, BC)
    row0 = (tl.program_id(0) // col_tiles) * BR * STEPS
    c = tl.arange(0, K)
    cm = cols[None, :] < n_cols
    rh = tl.load(rh_ptr + cols[None, :] * RHS + c[:, None], mask=cm, other=0.0)
    rg = tl.load(rg_ptr + cols[None, :] * RS + c[:, None], mask=cm, other=0.0)
    ru = tl.load(ru_ptr + cols[None, :] * RS + c[:, None], mask=cm, other=0.0)
    for i in tl.range(0, STEPS, num_stages=STAGES):
        rows = row0 + i * BR + tl.arange(0, BR)
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        m = (rows[:, None] < n_rows) & cm
        rm = rows[:, None] < n_rows
        dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        lh = tl.load(lh_ptr + rows[:, None] * LHS + c[None, :], mask=rm, other=0.0)
        lg = tl.load(lg_ptr + rows[:, None] * LS + c[None, :], mask=rm, other=0.0)
        lu = tl.load(lu_ptr + rows[:, None] * LS + c[None, :], mask=rm, other=0.0)
        dh += tl.dot(lh, rh)
        g += tl.dot(lg, rg)
        u += tl.dot(lu, ru)
        s = tl.sigmoid(g)
        tl.store(du_ptr + offs, (dh * g * s).to(du_ptr.dtype.element_ty), mask=m)
        tl.store(dg_ptr + offs, (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(h_ptr + offs, (g * s * u).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def k_plain_bwd(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(du_ptr + offs, (dh * g * s).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + offs, (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(h_ptr + offs, (g * s * u).to(h_ptr.dtype.element_ty), mask=m)


for name, I, N, r in (("llama-3.1-8b", 14336, 4096, 16), ("qwen2.5-0.5b 4x2048", 4864, 8192, 16)):
    torch.manual_seed(0)
    gu = torch.randn(2 * I, N, device=dev, dtype=bf)
    g, u = gu.chunk(2)
    dh = torch.randn(I, N, device=dev, dtype=bf)
    xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
    b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
    b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
    b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
    a_d = torch.randn(r, I, device=dev, dtype=bf) * 0.3
    dyb = torch.randn(N, r, device=dev, dtype=bf) * 0.3
    lg, lu, rg, ru = b[:I, :r], b[I:, r:], xa[:, :r], xa[:, r:]
    lh, rh = a_d.t(), dyb
    terms = ((lg, rg), (lu, ru))
    dgr, dur, hr = swiglu_backward(dh.clone(), g, u, write_h=True, terms=terms, dh_term=(lh, rh))
    dg, du, h = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
    n = g.numel()
    print(f"== {name}: I={I} N={N} r={r}", flush=True)
    t = timeit(lambda: k_plain_bwd[(triton.cdiv(n, 1024),)](dh, g, u, dg, du, h, n, BLOCK=1024, num_warps=4))
    print(f"  plain 1-d backward (no terms, write h): {t:.1f} us", flush=True)
    dh2 = dh.clone()
    t = timeit(lambda: swiglu_backward(dh2, g, u, write_h=True, terms=terms, dh_term=(lh, rh)))
    print(f"  tree's backward with terms (new dG, dU; h over dh): {t:.1f} us", flush=True)
    for br, bc, w, steps, stages in ((64, 64, 4, 8, 2), (64, 64, 4, 8, 3), (32, 128, 4, 8, 2), (32, 128, 4, 16, 2),
                                     (64, 32, 4, 8, 2), (64, 64, 8, 8, 2), (64, 128, 8, 8, 2), (32, 64, 4, 16, 2),
                                     (64, 64, 4, 4, 2)):
        grid = (triton.cdiv(I, br * steps) * triton.cdiv(N, bc),)
        try:
            f = lambda: k_loop_bwd[grid](dh, g, u, dg, du, h, lh, lg, lu, rh, rg, ru, I, N, lh.stride(0),
                                         rh.stride(0), b.stride(0), xa.stride(0), r, br, bc, steps, stages,
                                         num_warps=w)
            tt = timeit(f)
            err = max((x.float() - y.float()).abs().max().item() for x, y in ((dg, dgr), (du, dur), (h, hr)))
            print(f"  bwd loop {br}x{bc} w{w} steps {steps} stages {stages}: {tt:.1f} us (max err {err:.3g})",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  bwd loop {br}x{bc} w{w} steps {steps} stages {stages}: failed {type(e).__name__}: "
                  f"{str(e)[:300]}", flush=True)
    ref = swiglu_forward(g, u, terms=terms)
    for br, bc, w, steps, stages in ((64, 64, 4, 8, 3), (32, 128, 4, 8, 2), (32, 128, 4, 8, 3), (64, 64, 8, 8, 2),
                                     (32, 64, 4, 16, 2), (64, 64, 4, 4, 2), (16, 128, 4, 16, 2), (32, 256, 8, 8, 2)):
        grid = (triton.cdiv(I, br * steps) * triton.cdiv(N, bc),)
        f = lambda: k_loop[grid](g, u, h, lg, lu, rg, ru, I, N, b.stride(0), xa.stride(0), r, br, bc, steps, stages,
                                 num_warps=w)
        tt = timeit(f)
        err = (h.float() - ref.float()).abs().max().item()
        print(f"  fwd loop {br}x{bc} w{w} steps {steps} stages {stages}: {tt:.1f} us (max err {err:.3g})", flush=True)
