"""Session 41: the one-read adapter kernel's tile (BLOCK_F, BLOCK_T, warps, stages) with and without dY's e4m3
copy, Llama-3.1-8B's [dG | dU] (2 x 14336 x 4096, r 16), graph replays; outputs checked against the tree's config."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
import kernels.adapter_grads as ag
from kernels.fp8_quantize_tensor import fp8_quantize_tensor

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
ref = ag.adapter_grads(rows, p, b, 0.5, r, amax=amax)
print(f"quantize_tensor alone {bench(lambda: fp8_quantize_tensor(rows.t(), amax)):.1f} us", flush=True)
orig = ag.launch_config
for cfg in [(64, 256, 4, 2), (128, 128, 4, 2), (128, 128, 8, 2), (128, 128, 4, 3), (64, 256, 8, 2), (128, 256, 8, 2),
            (256, 64, 4, 2), (64, 128, 4, 3)]:
    ag.launch_config = lambda dtype, cfg=cfg: cfg
    try:
        t0 = bench(lambda: ag.adapter_grads(rows, p, b, 0.5, r))
        t1 = bench(lambda: ag.adapter_grads(rows, p, b, 0.5, r, amax=amax))
        db, q, (q8, s8) = ag.adapter_grads(rows, p, b, 0.5, r, amax=amax)
        same = torch.equal(q8.view(torch.uint8), ref[2][0].view(torch.uint8))
        err = ((db - ref[0]).abs().max().item(), (q.float() - ref[1].float()).abs().max().item())
        print(f"{cfg}: plain {t0:.1f} us, with e4m3 {t1:.1f} us; q8 equal {same}, dB/Q max diff {err}", flush=True)
    except Exception as e:
        print(f"{cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
ag.launch_config = orig
