"""Session 41: the one-read adapter kernel with and without dY's e4m3 copy, against the separate tensor-wise
quantization, at Llama-3.1-8B's [dG | dU] (2 x 14336 x 4096, r 16), CUDA-graph replays; and apply_rope_qkv's
backward against the split's concatenation at Llama-3.1-8B's q | k | v (2 x 2048 tokens)."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
from kernels.adapter_grads import adapter_grads
from kernels.fp8_quantize_tensor import fp8_quantize_tensor
from kernels.rope import apply_rope, apply_rope_qkv
from model.transformer import rope_cos_sin

def bench(fn, n=30, reps=5):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)

dev = "cuda"; bf = torch.bfloat16
I, N, r = 14336, 4096, 16
rows = torch.randn(2 * I, N, device=dev).to(bf)
p = torch.randn(N, 2 * r, device=dev).to(bf)
b = torch.zeros(2 * I, 2 * r, device=dev, dtype=bf)
b[:I, :r] = torch.randn(I, r, device=dev).to(bf); b[I:, r:] = torch.randn(I, r, device=dev).to(bf)
amax = rows.abs().amax()
t0 = bench(lambda: adapter_grads(rows, p, b, 0.5, r))
t1 = bench(lambda: adapter_grads(rows, p, b, 0.5, r, amax=amax))
t2 = bench(lambda: fp8_quantize_tensor(rows.t(), amax))
print(f"adapter_grads {t0:.1f} us; with the e4m3 copy {t1:.1f} us; fp8_quantize_tensor alone {t2:.1f} us; "
      f"separate {t0 + t2:.1f} -> fused {t1:.1f} us ({t1 - t0 - t2:+.1f})", flush=True)
_, _, (q8, s8) = adapter_grads(rows, p, b, 0.5, r, amax=amax)
q8r, s8r = fp8_quantize_tensor(rows.t(), amax)
print("bit-equal:", torch.equal(q8.view(torch.uint8), q8r.view(torch.uint8)), torch.equal(s8, s8r), flush=True)

B, T, Hq, Hk, D = 2, 2048, 32, 8, 128
inv = 1.0 / 500000 ** (torch.arange(0, D, 2, device=dev).float() / D)
cos, sin = rope_cos_sin(torch.arange(T, device=dev).expand(B, T), inv, bf)
qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, device=dev).to(bf).requires_grad_()
grads = [torch.randn(B, T, h, D, device=dev).to(bf) for h in (Hq, Hk, Hk)]
def old():
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], -1)
    q, k = apply_rope(q.view(B, T, Hq, D), k.view(B, T, Hk, D), cos, sin)
    torch.autograd.backward([q, k, v.contiguous().view(B, T, Hk, D)], grads)
def new():
    torch.autograd.backward(list(apply_rope_qkv(qkv, Hq, Hk, cos, sin)), grads)
for name, fn in (("split + apply_rope", old), ("apply_rope_qkv", new), ("split + apply_rope", old), ("apply_rope_qkv", new)):
    ts = []
    for _ in range(5):
        fn(); torch.cuda.synchronize()
        a, e = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(20):
            qkv.grad = None; fn()
        e.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(e) * 1e3 / 20)
    print(f"{name}: forward + backward {statistics.median(ts):.1f} us (eager)", flush=True)
