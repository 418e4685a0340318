"""The MLP activation with the adapters' terms inside (kernels/glu.py TERMS) against the add pass + 1-d kernel it
replaces, forward and backward, at Llama-3.1-8B's (fp8 path) and TinyLlama's (bf16 LoRA) shapes; tile sweep."""
import statistics, sys, os
sys.path.insert(0, os.getcwd())
import torch
import kernels.glu as glu
from kernels.swiglu import swiglu_forward, swiglu_backward

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
        e.record(); e.synchronize()
        out.append(s.elapsed_time(e) / reps * 1e3)
    return statistics.median(out)


for name, I, N, r in (("llama-3.1-8b", 14336, 4096, 16), ("tinyllama 4x2048", 5632, 8192, 16),
                      ("qwen2.5-0.5b 4x2048", 4864, 8192, 16)):
    gu = torch.randn(2 * I, N, device=dev, dtype=bf)  # [G | U] stored transposed
    xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
    b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
    b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
    b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
    dh = torch.randn(I, N, device=dev, dtype=bf)
    a_d = torch.randn(r, I, device=dev, dtype=bf) * 0.3
    dyb = torch.randn(N, r, device=dev, dtype=bf) * 0.3
    g, u = gu.chunk(2)
    terms = ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:]))

    def old_fwd():
        y = gu.clone()
        y.t().addmm_(xa, b.t())
        return swiglu_forward(*y.chunk(2))

    gu_c = gu.clone()
    def only_clone():
        gu_c.copy_(gu)
    t_clone = timeit(only_clone)

    def old_bwd():
        d = dh.clone()
        d.t().addmm_(dyb, a_d)
        g2, u2 = gu.clone().chunk(2)
        return swiglu_backward(d, g2, u2, inplace=True, write_h=True)

    h_ref = old_fwd()
    print(f"== {name}: I={I} N={N}; copy of [G|U] alone {t_clone:.1f} us (subtracted below)", flush=True)
    print(f"  old fwd (add pass + 1-d kernel) {timeit(old_fwd) - t_clone:.1f} us; old bwd "
          f"{timeit(old_bwd) - t_clone - t_clone / 2:.1f} us", flush=True)
    base = (glu.BLOCK_R, glu.BLOCK_C, glu.TILE_WARPS)
    for br, bc, w in ((64, 64, 4), (32, 64, 4), (64, 32, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (64, 64, 8),
                      (128, 64, 8), (128, 128, 8), (16, 64, 2), (32, 32, 2)):
        glu.BLOCK_R, glu.BLOCK_C, glu.TILE_WARPS = br, bc, w
        h = swiglu_forward(g, u, terms=terms)
        err = (h.float() - h_ref.float()).abs().max().item()
        tf = timeit(lambda: swiglu_forward(g, u, terms=terms))
        def new_bwd():
            d = dh.clone()
            g2, u2 = gu.clone().chunk(2)
            return swiglu_backward(d, g2, u2, inplace=True, write_h=True, terms=terms, dh_term=(a_d.t(), dyb))
        tb = timeit(new_bwd) - t_clone - t_clone / 2
        def new_bwd_gu_only():
            d = dh.clone()
            d.t().addmm_(dyb, a_d)
            g2, u2 = gu.clone().chunk(2)
            return swiglu_backward(d, g2, u2, inplace=True, write_h=True, terms=terms)
        tb2 = timeit(new_bwd_gu_only) - t_clone - t_clone / 2
        print(f"  tile {br}x{bc} w{w}: fwd {tf:.1f} us (max |h - old| {err:.3g}), bwd {tb:.1f} us, bwd with dH's "
              f"add pass {tb2:.1f} us", flush=True)
    glu.BLOCK_R, glu.BLOCK_C, glu.TILE_WARPS = base
    print(f"  plain 1-d fwd (no terms) {timeit(lambda: swiglu_forward(g, u)):.1f} us", flush=True)
