"""Session 27: SwiGLU's launch (BLOCK, warps) on Qwen2.5-7B's and Llama-3.1-8B's MLP at 4096 tokens, CUDA-graph replays."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import kernels.glu as glu
from kernels.swiglu import swiglu_backward, swiglu_forward
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms

N = 4096
for name, I in (("qwen2.5-7b", 18944), ("llama-3.1-8b", 14336)):
    gu = torch.randn(2 * I, N, device="cuda", dtype=torch.bfloat16)
    g, u = gu[:I], gu[I:]
    dh = torch.randn(I, N, device="cuda", dtype=torch.bfloat16)
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            glu.BLOCK, glu.NUM_WARPS = block, warps
            f = median_ms(replayed(lambda: swiglu_forward(g, u)), "cuda")
            b = median_ms(replayed(lambda: swiglu_backward(dh, g, u, inplace=True)), "cuda")
            print(f"{name} BLOCK {block} warps {warps}: forward {f * 1e3:.1f} us ({3 * I * N * 2 / f / 1e9:.2f} TB/s), "
                  f"backward in place {b * 1e3:.1f} us ({5 * I * N * 2 / b / 1e9:.2f} TB/s)", flush=True)
