"""Session 35: why the SwiGLU forward with the adapters' low-rank terms (kernels/glu.py TERMS) takes ~1.8x the plain
1-d kernel. Standalone variants at Llama-3.1-8B's MLP (I 14336, N 4096, r 16) and Qwen2.5-0.5B 4x2048 (4864, 8192):
plain 1-d; 2-d tiles without terms; tiles with the terms (as the tree); a program looping over row tiles with the
token tile's R kept; the tree's kernel itself."""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl

from kernels.swiglu import swiglu_forward

dev, bf = torch.device("cuda"), torch.bfloat16


def timeit(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / reps * 1e3)
    return statistics.median(out)


@triton.jit
def k_plain(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _term(l_ptr, r_ptr, rows, cols, n_rows, n_cols, LS: tl.constexpr, RS: tl.constexpr, K: tl.constexpr):
    c = tl.arange(0, K)
    left = tl.load(l_ptr + rows[:, None] * LS + c[None, :], mask=rows[:, None] < n_rows, other=0.0)
    right = tl.load(r_ptr + cols[None, :] * RS + c[:, None], mask=cols[None, :] < n_cols, other=0.0)
    return tl.dot(left, right)


@triton.jit
def k_tile(g_ptr, u_ptr, h_ptr, lg_ptr, lu_ptr, rg_ptr, ru_ptr, n_rows, n_cols, LS: tl.constexpr,
           RS: tl.constexpr, K: tl.constexpr, TERMS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    col_tiles = tl.cdiv(n_cols, BC)
    rows = (tl.program_id(0) // col_tiles) * BR + tl.arange(0, BR)
    cols = (tl.program_id(0) % col_tiles) * BC + tl.arange(0, BC)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    m = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if TERMS:
        g += _term(lg_ptr, rg_ptr, rows, cols, n_rows, n_cols, LS, RS, K)
        u += _term(lu_ptr, ru_ptr, rows, cols, n_rows, n_cols, LS, RS, K)
    tl.store(h_ptr + offs, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def k_loop(g_ptr, u_ptr, h_ptr, lg_ptr, lu_ptr, rg_ptr, ru_ptr, n_rows, n_cols, LS: tl.constexpr,
           RS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr,
           STAGES: tl.constexpr):
    """A program: BC token columns, STEPS row tiles of BR; R of gate and up loaded once."""
    col_tiles = tl.cdiv(n_cols, BC)
    cols = (tl.program_id(0) % col_tiles) * BC + tl.arange(0, BC)
    row0 = (tl.program_id(0) // col_tiles) * BR * STEPS
    c = tl.arange(0, K)
    rg = tl.load(rg_ptr + cols[None, :] * RS + c[:, None], mask=cols[None, :] < n_cols, other=0.0)
    ru = tl.load(ru_ptr + cols[None, :] * RS + c[:, None], mask=cols[None, :] < n_cols, other=0.0)
    for i in tl.range(0, STEPS, num_stages=STAGES):
        rows = row0 + i * BR + tl.arange(0, BR)
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        m = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        lg = tl.load(lg_ptr + rows[:, None] * LS + c[None, :], mask=rows[:, None] < n_rows, other=0.0)
        lu = tl.load(lu_ptr + rows[:, None] * LS + c[None, :], mask=rows[:, None] < n_rows, other=0.0)
        g += tl.dot(lg, rg)
        u += tl.dot(lu, ru)
        tl.store(h_ptr + offs, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=m)


if __name__ == "__main__":
    for name, I, N, r in (("llama-3.1-8b", 14336, 4096, 16), ("qwen2.5-0.5b 4x2048", 4864, 8192, 16)):
        torch.manual_seed(0)
        gu = torch.randn(2 * I, N, device=dev, dtype=bf)
        g, u = gu.chunk(2)
        xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
        b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
        b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
        b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
        lg, lu, rg, ru = b[:I, :r], b[I:, r:], xa[:, :r], xa[:, r:]
        terms = ((lg, rg), (lu, ru))
        ref = swiglu_forward(g, u, terms=terms)
        h = torch.empty_like(g)
        n = g.numel()
        print(f"== {name}: I={I} N={N} r={r}", flush=True)
        t = timeit(lambda: k_plain[(triton.cdiv(n, 1024),)](g, u, h, n, BLOCK=1024, num_warps=4))
        print(f"  plain 1-d (no terms): {t:.1f} us", flush=True)
        print(f"  tree's kernel with terms: {timeit(lambda: swiglu_forward(g, u, terms=terms)):.1f} us", flush=True)
        LS, RS = b.stride(0), xa.stride(0)
        for br, bc, w in ((64, 32, 4), (64, 64, 4), (32, 128, 4), (64, 128, 8), (128, 128, 8)):
            grid = (triton.cdiv(I, br) * triton.cdiv(N, bc),)
            for terms_on in (False, True):
                f = lambda: k_tile[grid](g, u, h, lg, lu, rg, ru, I, N, LS, RS, r, terms_on, br, bc, num_warps=w)
                tt = timeit(f)
                err = (h.float() - ref.float()).abs().max().item() if terms_on else float("nan")
                print(f"  tile {br}x{bc} w{w} terms={terms_on}: {tt:.1f} us (max err {err:.3g})", flush=True)
        for br, bc, w, steps, stages in ((64, 32, 4, 8, 1), (64, 32, 4, 8, 2), (64, 64, 4, 8, 2), (32, 128, 4, 16, 2),
                                         (64, 128, 8, 8, 2), (64, 64, 4, 32, 3), (128, 64, 8, 8, 2)):
            grid = (triton.cdiv(I, br * steps) * triton.cdiv(N, bc),)
            try:
                f = lambda: k_loop[grid](g, u, h, lg, lu, rg, ru, I, N, LS, RS, r, br, bc, steps, stages, num_warps=w)
                tt = timeit(f)
                err = (h.float() - ref.float()).abs().max().item()
                print(f"  loop {br}x{bc} w{w} steps {steps} stages {stages}: {tt:.1f} us (max err {err:.3g})",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  loop {br}x{bc} w{w} steps {steps} stages {stages}: failed {type(e).__name__}: {str(e)[:200]}")
