"""Session 36: down's adapter products with H inside the SwiGLU kernels (h_q) against the kernels plus the GEMMs
they replace, bf16, median of 5 x 30 launches, at Llama-3.1-8B's MLP (2 x 2048) and Qwen2.5-0.5B's 4 x 2048; with the
gate/up/dH terms (the --fp8 path, bf16 LoRA on full-precision weights) and without (the exact NF4 path: 1-d kernels
before). python t4.py"""
import hashlib
import statistics
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

import kernels.glu as glu  # noqa: E402
from kernels.swiglu import swiglu_backward, swiglu_forward  # noqa: E402

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


for name, I, N, r in (("llama-3.1-8b 2x2048", 14336, 4096, 16), ("qwen2.5-0.5b 4x2048", 4864, 8192, 16)):
    torch.manual_seed(0)
    gu = torch.randn(2 * I, N, device=dev, dtype=bf)
    xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
    b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
    b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
    b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
    dh = torch.randn(I, N, device=dev, dtype=bf)
    a_d = torch.randn(r, I, device=dev, dtype=bf) * 0.3
    dyb = torch.randn(N, r, device=dev, dtype=bf) * 0.3
    terms = ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:]))
    g, u = gu.chunk(2)
    print(f"== {name}: [G|U] {tuple(gu.shape)}", flush=True)
    # values: the kernels' products against the GEMMs' on the same h
    h, hq = swiglu_forward(g, u, terms=terms, h_q=a_d.t())
    ref_f = torch.mm(h.t(), a_d.t(), out_dtype=torch.float32)
    _, _, hb = swiglu_backward(dh.clone(), g.clone(), u.clone(), inplace=True, terms=terms, dh_term=(a_d.t(), dyb),
                               h_q=dyb)
    ref_b = torch.mm(dyb.t(), h.t(), out_dtype=torch.float32)
    print(f"  max |hq - GEMM| forward {(hq - ref_f).abs().max().item():.3g} (max |GEMM| {ref_f.abs().max().item():.3g}),"
          f" backward {(hb - ref_b).abs().max().item():.3g} (max {ref_b.abs().max().item():.3g})", flush=True)
    print("  h sha1", hashlib.sha1(h.float().cpu().numpy().tobytes()).hexdigest()[:12], flush=True)
    amax = torch.empty((), device=dev, dtype=bf)
    work, dwork = gu.clone(), dh.clone()
    for tag, kw, dkw in (("terms (fp8 path)", dict(terms=terms, amax=amax), dict(terms=terms, dh_term=(a_d.t(), dyb),
                                                                                    amax=amax)),
                         ("no terms (exact NF4 path)", {}, {})):
        def f_old():
            hh = swiglu_forward(g, u, **kw)
            return torch.addmm(hh.new_empty(N, r), hh.t(), a_d.t(), beta=0, alpha=2.0)

        def f_new():
            hh, p = swiglu_forward(g, u, **kw, h_q=a_d.t())
            return (p * 2.0).to(bf)

        def b_old():
            w1, w2 = work.chunk(2)
            _, _, hh = swiglu_backward(dwork, w1, w2, inplace=True, write_h=True, **dkw)
            return torch.mm(dyb.t(), hh.t(), out_dtype=torch.float32)

        def b_new():
            w1, w2 = work.chunk(2)
            return swiglu_backward(dwork, w1, w2, inplace=True, **dkw, h_q=dyb)[2]

        def f_kernel():
            return swiglu_forward(g, u, **kw)

        def b_kernel():
            w1, w2 = work.chunk(2)
            return swiglu_backward(dwork, w1, w2, inplace=True, write_h=True, **dkw)
        print(f"  {tag}: forward kernel+GEMM {timeit(f_old):.1f} us (kernel {timeit(f_kernel):.1f}); "
              f"backward kernel+GEMM {timeit(b_old):.1f} (kernel {timeit(b_kernel):.1f})", flush=True)
        for warps in (4, 8):
            glu.TILE_WARPS = warps
            print(f"    h_q, {warps} warps: forward {timeit(f_new):.1f} us, backward {timeit(b_new):.1f} us", flush=True)
        glu.TILE_WARPS = 4
