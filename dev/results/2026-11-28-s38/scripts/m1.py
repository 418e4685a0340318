"""Call 1 micro-benchmarks: (a) LM-head chunk GEMM shapes; (b) y + r + L R^T in one pass vs add_ + addmm_."""
import json, os, sys
import torch, triton, triton.language as tl
from triton.testing import do_bench
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
torch.manual_seed(0)
rows = []
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
# (a) LM head: forward logits = h @ W^T for a chunk of M rows; backward dH = G @ W.
for name, H, V in [("llama-3.1-8b", 4096, 128256), ("qwen2.5-7b", 3584, 152064), ("gemma-2-9b", 3584, 256000),
                   ("tinyllama", 2048, 32000), ("qwen2.5-0.5b", 896, 151936), ("smollm2", 576, 49152)]:
    W = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02
    for M in (256, 512, 640, 768, 1024, 2048):
        h = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        G = torch.randn(M, V, device=dev, dtype=torch.bfloat16)
        fl = 2 * M * H * V
        f = do_bench(lambda: torch.mm(h, W.t()), warmup=50, rep=200)
        ft = do_bench(lambda: torch.mm(W, h.t()), warmup=50, rep=200)
        b = do_bench(lambda: torch.mm(G, W), warmup=50, rep=200)
        r = dict(case=name, M=M, fwd_ms=f, fwd_tf=fl / f / 1e9, fwdT_ms=ft, fwdT_tf=fl / ft / 1e9, bwd_ms=b, bwd_tf=fl / b / 1e9)
        rows.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        del h, G
    del W
    torch.cuda.empty_cache()

# (b) out = y + r + L R^T (y, r: (N, C) bf16; L (N, k), R (C, k))
@triton.jit
def _add_lowrank_kernel(y_ptr, r_ptr, l_ptr, rr_ptr, out_ptr, N, C, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pm = tl.program_id(1)
    pn = tl.program_id(0)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    ks = tl.arange(0, K)
    l = tl.load(l_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < N, other=0.0)
    rr = tl.load(rr_ptr + cols[:, None] * K + ks[None, :], mask=cols[:, None] < C, other=0.0)
    acc = tl.dot(l, tl.trans(rr))
    offs = rows[:, None] * C + cols[None, :]
    m = (rows[:, None] < N) & (cols[None, :] < C)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (acc + y + r).to(out_ptr.dtype.element_ty), mask=m)

def fused(y, r, L, R, BM, BN, warps):
    N, C = y.shape
    _add_lowrank_kernel[(triton.cdiv(C, BN), triton.cdiv(N, BM))](y, r, L, R, y, N, C, K=L.shape[1], BM=BM, BN=BN, num_warps=warps)
    return y

for N, C in ((4096, 4096), (4096, 3584), (16384, 4096)):
    y0 = torch.randn(N, C, device=dev, dtype=torch.bfloat16)
    r = torch.randn(N, C, device=dev, dtype=torch.bfloat16)
    L = torch.randn(N, 16, device=dev, dtype=torch.bfloat16)
    R = torch.randn(C, 16, device=dev, dtype=torch.bfloat16) * 0.1
    y = y0.clone()
    def now():
        y.copy_(y0)
        y.add_(r)
        y.addmm_(L, R.t())
    def copy_only():
        y.copy_(y0)
    t_copy = do_bench(copy_only, warmup=50, rep=300)
    t_now = do_bench(now, warmup=50, rep=300) - t_copy
    y.copy_(y0); y.add_(r); y.addmm_(L, R.t()); ref = y.float().clone()
    for BM, BN, w in ((64, 128, 4), (128, 128, 8), (64, 256, 8), (32, 128, 4), (128, 64, 4)):
        y.copy_(y0)
        fused(y, r, L, R, BM, BN, w)
        err = (y.float() - ref).abs().max().item()
        t = do_bench(lambda: (y.copy_(y0), fused(y, r, L, R, BM, BN, w)), warmup=50, rep=300) - t_copy
        rec = dict(case="add_lowrank", N=N, C=C, now_us=t_now * 1e3, fused_us=t * 1e3, BM=BM, BN=BN, warps=w, err=err,
                   fused_TBps=3 * N * C * 2 / t / 1e9)
        rows.append(rec)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
json.dump(rows, open(os.path.join(OUT, "m1.json"), "w"), indent=1)
