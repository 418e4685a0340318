"""Session 27: the GLU backward with the adapters' products, launch sweep incl. num_stages, and without its dots (p, q None)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import kernels.glu_lora_backward as glb
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms

N, r = 4096, 16
for name, I in (("qwen2.5-7b", 18944), ("llama-3.1-8b", 14336)):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(2 * I, N, **bf) * 0.1
    g, u = gu[:I], gu[I:]
    dh = torch.randn(I, N, **bf) * 0.1
    p = torch.randn(N, 2 * r, **bf)
    q = torch.randn(N, r, **bf)
    best = []
    for bf_, bt, w, st in ((64, 32, 4, 3), (64, 32, 4, 1), (64, 32, 4, 2), (64, 32, 4, 4), (64, 64, 4, 1), (64, 64, 4, 2),
                           (64, 64, 8, 2), (128, 32, 4, 2), (128, 32, 8, 2), (128, 16, 4, 2), (64, 16, 4, 2), (32, 32, 2, 2),
                           (64, 32, 2, 2), (128, 64, 8, 2)):
        glb.BLOCK_F, glb.BLOCK_T, glb.NUM_WARPS, glb.NUM_STAGES = bf_, bt, w, st
        try:
            t = median_ms(replayed(lambda: glb.glu_lora_backward(dh, g, u, p, r, q, "silu")), "cuda")
            t0 = median_ms(replayed(lambda: glb.glu_lora_backward(dh, g, u, None, 0, None, "silu")), "cuda")
        except Exception as e:
            print(f"  {bf_} {bt} {w} {st}: {type(e).__name__} {str(e)[:100]}", flush=True); continue
        print(f"{name} BLOCK_F {bf_} BLOCK_T {bt} warps {w} stages {st}: {t * 1e3:.1f} us with the products, {t0 * 1e3:.1f} without "
              f"({5 * I * N * 2 / t / 1e9:.2f}, {5 * I * N * 2 / t0 / 1e9:.2f} TB/s)", flush=True)
