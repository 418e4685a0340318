"""Session 35: the GLU kernels of one tree (ROOT), bf16, median of 5 x 30 launches: SwiGLU forward and backward with
the adapters' low-rank terms (r 16; backward with dH's term, in place, h written over dh) and without (the 1-d
blocks), at Llama-3.1-8B's MLP (fp8 path), TinyLlama's and Qwen2.5-0.5B's 4 x 2048. SWEEP=1: the tile constants too.
python t3.py ROOT"""
import os
import statistics
import sys

root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
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


def cases():
    for name, I, N, r in (("llama-3.1-8b", 14336, 4096, 16), ("tinyllama 4x2048", 5632, 8192, 16),
                          ("qwen2.5-0.5b 4x2048", 4864, 8192, 16)):
        torch.manual_seed(0)
        gu = torch.randn(2 * I, N, device=dev, dtype=bf)
        xa = torch.randn(N, 2 * r, device=dev, dtype=bf) * 0.3
        b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
        b[:I, :r] = torch.randn(I, r, device=dev) * 0.3
        b[I:, r:] = torch.randn(I, r, device=dev) * 0.3
        dh = torch.randn(I, N, device=dev, dtype=bf)
        a_d = torch.randn(r, I, device=dev, dtype=bf) * 0.3
        dyb = torch.randn(N, r, device=dev, dtype=bf) * 0.3
        yield name, gu, dh, ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:])), (a_d.t(), dyb)


def measure(tag, gu, dh, terms, dh_term):
    g, u = gu.chunk(2)
    amax = torch.empty((), device=dev, dtype=bf)
    fwd = timeit(lambda: swiglu_forward(g, u, terms=terms, amax=amax))
    work = gu.clone()
    dwork = dh.clone()

    def bwd():  # in place over copies, as the LoRA MLP runs it (the copies' time is not subtracted; equal in both)
        w1, w2 = work.chunk(2)
        return swiglu_backward(dwork, w1, w2, inplace=True, write_h=True, amax=amax, terms=terms, dh_term=dh_term)
    bw = timeit(bwd)
    print(f"  {tag}: forward {fwd:.1f} us, backward {bw:.1f} us", flush=True)


for name, gu, dh, terms, dh_term in cases():
    print(f"== {root} {name}: [G|U] {tuple(gu.shape)}", flush=True)
    g, u = gu.chunk(2)
    h = swiglu_forward(g, u, terms=terms)
    dg, du, h2 = swiglu_backward(dh.clone(), g.clone(), u.clone(), write_h=True, terms=terms, dh_term=dh_term)
    import hashlib
    digest = hashlib.sha1(b"".join(t.float().cpu().numpy().tobytes() for t in (h, dg, du, h2))).hexdigest()[:12]
    print(f"  outputs sha1 {digest}", flush=True)
    measure("terms (gate, up; dH's)", gu, dh, terms, dh_term)
    measure("1-d, no terms", gu, dh, None, None)
    if os.environ.get("SWEEP"):
        base = (glu.BLOCK_R, glu.BLOCK_C, glu.STEPS, glu.STAGES, glu.TILE_WARPS)
        for cfg in ((32, 128, 8, 3, 4), (64, 64, 8, 2, 4), (32, 128, 16, 2, 4)):
            glu.BLOCK_R, glu.BLOCK_C, glu.STEPS, glu.STAGES, glu.TILE_WARPS = cfg
            measure(f"terms {cfg[0]}x{cfg[1]} steps {cfg[2]} stages {cfg[3]} warps {cfg[4]}", gu, dh, terms, dh_term)
        glu.BLOCK_R, glu.BLOCK_C, glu.STEPS, glu.STAGES, glu.TILE_WARPS = base
