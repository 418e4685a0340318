"""The adapters' rank-r adds into a full output, y += s X W (K = Σr): cuBLAS's addmm_ as model/lora.py calls it,
against a Triton prototype, at Llama-3.1-8B's (and Qwen2.5-7B's) shapes, 2 x 2048 tokens; L2 defeated by rotating
over 4 outputs. Also the bf16 path's alternative: the base GEMM taking the adapter product as its C."""
import os, sys, statistics
import torch
import triton
import triton.language as tl


@triton.jit
def _k(y_ptr, x_ptr, w_ptr, M, N, K, sym, sxm, sxk, swk, swn, alpha,
       KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, YFIRST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, KP)
    ymask = (m[:, None] < M) & (n[None, :] < N)
    yp = y_ptr + m[:, None].to(tl.int64) * sym + n[None, :]
    if YFIRST:
        y = tl.load(yp, mask=ymask)
    x = tl.load(x_ptr + m[:, None] * sxm + k[None, :] * sxk, mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
    w = tl.load(w_ptr + k[:, None] * swk + n[None, :] * swn, mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
    acc = tl.dot(x, w)
    if not YFIRST:
        y = tl.load(yp, mask=ymask)
    tl.store(yp, (y.to(tl.float32) + alpha * acc).to(y_ptr.dtype.element_ty), mask=ymask)


def tri(y, x, w, alpha, bm=128, bn=128, warps=8, yfirst=True, stages=1):
    if y.stride(1) != 1:  # column-major y: the transposed problem
        y, x, w = y.t(), w.t(), x.t()
    M, N = y.shape
    K = x.shape[1]
    kp = max(16, triton.next_power_of_2(K))
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _k[grid](y, x, w, M, N, K, y.stride(0), x.stride(0), x.stride(1), w.stride(0), w.stride(1), alpha,
             KP=kp, BM=bm, BN=bn, YFIRST=yfirst, num_warps=warps, num_stages=stages)


def timeit(fn, reps=40):
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(reps):
            fn(i)
        e.record(); e.synchronize()
        out.append(s.elapsed_time(e) / reps * 1e3)
    return statistics.median(out)


dev = torch.device("cuda")
T = 4096
bf = torch.bfloat16


def shapes(hidden, inter, qkv_out):
    # name: (y shape as stored, transposed view?, x (T, K) layout "rm"|"cm", w (K, out) layout "rm"|"cm", K)
    return {
        "qkv dX": ((T, hidden), False, "rm", "rm", 48),
        "o dX": ((T, hidden), False, "rm", "rm", 16),
        "gu dX (fp8)": ((T, hidden), False, "cm", "rm", 32),
        "down fwd": ((T, hidden), False, "rm", "cm", 16),
        "qkv fwd (fp8)": ((T, qkv_out), False, "rm", "cm", 48),
        "gu fwd (fp8)": ((2 * inter, T), True, "rm", "cm", 32),
        "down dX (fp8)": ((inter, T), True, "rm", "rm", 16),
    }


def make(shape, transposed, xl, wl, K):
    ys = [torch.randn(shape, device=dev, dtype=bf) for _ in range(4)]
    out = shape[0] if not transposed else shape[0]
    if transposed:
        ys = [y.t() for y in ys]  # (T, out) view with strides (1, T)
        out = shape[0]
    else:
        out = shape[1]
    x = torch.randn(T, K, device=dev, dtype=bf) if xl == "rm" else torch.randn(K, T, device=dev, dtype=bf).t()
    w = torch.randn(K, out, device=dev, dtype=bf) / 8 if wl == "rm" else (torch.randn(out, K, device=dev, dtype=bf) / 8).t()
    return ys, x, w


for model, (hidden, inter, qkv_out) in {"llama-3.1-8b": (4096, 14336, 6144), "qwen2.5-7b": (3584, 18944, 4608)}.items():
    print(f"== {model}", flush=True)
    for name, (shape, transposed, xl, wl, K) in shapes(hidden, inter, qkv_out).items():
        if model == "qwen2.5-7b" and K == 48:
            K = 48
        ys, x, w = make(shape, transposed, xl, wl, K)
        nbytes = ys[0].numel() * 4
        ref = ys[0].float() + 0.5 * (x.float() @ w.float())
        res = {}
        res["cublas addmm_"] = timeit(lambda i: ys[i % 4].addmm_(x, w, alpha=0.5))
        res["cublas mm (no C)"] = timeit(lambda i: torch.mm(x, w))
        for bm, bn, warps, yfirst in [(64, 128, 4, True), (128, 128, 8, True), (128, 128, 4, True), (64, 256, 8, True),
                                      (128, 64, 4, True), (128, 128, 8, False), (256, 128, 8, True)]:
            y0 = ys[0].clone()
            ychk = ys[0]
            ys0 = ys[0].clone()
            tri(ychk, x, w, 0.5, bm, bn, warps, yfirst)
            err = (ychk.float() - ref).abs().max().item()
            ys[0].copy_(ys0)
            res[f"triton {bm}x{bn} w{warps}{'' if yfirst else ' ylast'} (err {err:.3g})"] = timeit(
                lambda i: tri(ys[i % 4], x, w, 0.5, bm, bn, warps, yfirst))
        for k, v in res.items():
            print(f"  {name:15s} y{tuple(ys[0].shape)} K={K}: {k:38s} {v:7.1f} us  {nbytes / v / 1e6:5.2f} TB/s", flush=True)
    # bf16 path: qkv dX and o dX as base GEMM + addmm_ (today) vs addmm(C = adapter product, dY, W)
    for name, K_in, r in (("qkv dX", qkv_out, 48), ("o dX", hidden, 16)):
        dy = torch.randn(T, K_in, device=dev, dtype=bf)
        W = torch.randn(K_in, hidden, device=dev, dtype=bf) / 64
        dyb = torch.randn(T, r, device=dev, dtype=bf)
        a = torch.randn(r, hidden, device=dev, dtype=bf) / 8
        today = timeit(lambda i: torch.mm(dy, W).addmm_(dyb, a))
        base_only = timeit(lambda i: torch.mm(dy, W))
        c_first = timeit(lambda i: torch.addmm(torch.mm(dyb, a), dy, W))
        def tri_after(i):
            y = torch.mm(dy, W); tri(y, dyb, a, 1.0)
        t_after = timeit(tri_after)
        d1 = torch.mm(dy, W).addmm_(dyb, a).float(); d2 = torch.addmm(torch.mm(dyb, a), dy, W).float()
        print(f"  bf16 {name}: base+addmm_ {today:.1f} us, base alone {base_only:.1f}, addmm(C=adapter) {c_first:.1f}, "
              f"base+triton {t_after:.1f}; max diff {(d1 - d2).abs().max().item():.3g}", flush=True)
