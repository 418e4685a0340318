"""Session 27: the GLU backward with the adapters' products against the in-place backward (writing H) and the three
GEMMs it replaces (dB_gate, dB_up, dA_down), bf16, 4096 tokens, r 16, CUDA-graph replays; then its launch sweep."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import kernels.glu_lora_backward as glb
from kernels.swiglu import swiglu_backward
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
    def plain():
        dg, du, h = swiglu_backward(dh, g, u, inplace=True, write_h=True)
        torch.mm(dg, p[:, :r], out_dtype=torch.float32); torch.mm(du, p[:, r:], out_dtype=torch.float32)
        torch.mm(q.t(), h.t(), out_dtype=torch.float32)
    def gemms():
        torch.mm(g, p[:, :r], out_dtype=torch.float32); torch.mm(u, p[:, r:], out_dtype=torch.float32)
        torch.mm(q.t(), dh.t(), out_dtype=torch.float32)
    t_plain = median_ms(replayed(plain), "cuda")
    t_gemms = median_ms(replayed(gemms), "cuda")
    print(f"{name}: in-place backward + write H + 3 GEMMs {t_plain * 1e3:.1f} us (the GEMMs alone {t_gemms * 1e3:.1f})", flush=True)
    for bf_, bt, w in ((32, 64, 4), (16, 64, 4), (64, 64, 4), (32, 128, 4), (32, 128, 8), (64, 128, 8), (16, 128, 4), (64, 32, 4)):
        glb.BLOCK_F, glb.BLOCK_T, glb.NUM_WARPS = bf_, bt, w
        t = median_ms(replayed(lambda: glb.glu_lora_backward(dh, g, u, p, r, q, "silu")), "cuda")
        print(f"  fused BLOCK_F {bf_} BLOCK_T {bt} warps {w}: {t * 1e3:.1f} us ({5 * I * N * 2 / t / 1e9:.2f} TB/s of its 5 tensors)", flush=True)
