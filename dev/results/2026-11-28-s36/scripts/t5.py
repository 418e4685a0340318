"""Session 36: below MIN_TERM_ELEMENTS: the SwiGLU kernels with the adapters' terms (r 16) against the add passes
(cuBLAS addmm_ into [G | U] and into dH) plus the 1-d kernels, bf16, median of 5 x 30 launches, at gate sizes from
SmolLM2-135M 8 x 512 (6.3M elements) up to 2^24. python t5.py"""
import statistics
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

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


r = 16
for name, I, N in (("smollm2-135m 8x512", 1536, 4096), ("smollm2-135m 4x512", 1536, 2048),
                   ("qwen2.5-0.5b 1x2048", 4864, 2048), ("tinyllama 1x2048", 5632, 2048),
                   ("2^24: tinyllama 4x727", 5632, 2979)):
    torch.manual_seed(0)
    gu = torch.randn(2 * I, N, device=dev, dtype=bf)
    xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
    b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
    b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
    b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
    dh = torch.randn(I, N, device=dev, dtype=bf)
    a_d = torch.randn(r, I, device=dev, dtype=bf) * 0.01
    dyb = torch.randn(N, r, device=dev, dtype=bf) * 0.01
    terms = ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:]))
    work, dwork = gu.clone(), dh.clone()

    def f_old():  # what lora.py runs below the threshold: one addmm_ of the block B into [G | U], the 1-d kernel
        work.addmm_(b, xa.t(), alpha=1e-3)
        g, u = work.chunk(2)
        return swiglu_forward(g, u)

    def f_new():
        g, u = gu.chunk(2)
        return swiglu_forward(g, u, terms=terms)

    def b_old():
        dwork.addmm_(a_d.t(), dyb.t())
        w1, w2 = work.chunk(2)
        return swiglu_backward(dwork, w1, w2, inplace=True, write_h=True)

    def b_new():
        w1, w2 = work.chunk(2)
        return swiglu_backward(dwork, w1, w2, inplace=True, write_h=True, terms=terms, dh_term=(a_d.t(), dyb))
    print(f"{name} (gate {I * N / 2**20:.1f}M elements): forward add+1-d {timeit(f_old):.1f} us, terms "
          f"{timeit(f_new):.1f} us; backward add+1-d {timeit(b_old):.1f} us, terms {timeit(b_new):.1f} us", flush=True)
