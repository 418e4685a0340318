"""Decoding GEMMs at 16 rows: cuBLAS (F.linear) against a Triton kernel with one program per BN output columns and
split-K with a deterministic last-arriver reduction, each timed as a CUDA graph over L distinct weights (the
layers': no L2 reuse). Prints per shape the cuBLAS time a call and the best Triton configs."""
import itertools, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F


@triton.jit
def _skinny(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, sxm, swn, sym,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    span = K // SPLIT
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(pid_k * span, (pid_k + 1) * span, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + n[None, :] * swn + k[:, None], mask=n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
    out = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT == 1:
        tl.store(y_ptr + m[:, None] * sym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)
    else:
        tl.store(part_ptr + pid_k * BM * N + m[:, None] * N + n[None, :], acc, mask=out)
        old = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if old == SPLIT - 1:
            tot = tl.zeros((BM, BN), tl.float32)
            for s in range(SPLIT):
                tot += tl.load(part_ptr + s * BM * N + m[:, None] * N + n[None, :], mask=out, other=0.0)
            tl.store(y_ptr + m[:, None] * sym + n[None, :], tot.to(y_ptr.dtype.element_ty), mask=out)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def triton_linear(x, w, y, part, count, BN, BK, SPLIT, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    _skinny[(triton.cdiv(N, BN), SPLIT)](x, w, y, part, count, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                         BM=16, BN=BN, BK=BK, SPLIT=SPLIT, num_warps=warps, num_stages=stages)


def graph_time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best * 1e3  # us a graph


SHAPES = {"qwen": dict(L=24, qkv=(896, 1152), o=(896, 896), gu=(896, 9728), down=(4864, 896)),
          "smol": dict(L=30, qkv=(576, 960), o=(576, 576), gu=(576, 3072), down=(1536, 576))}
dev = torch.device("cuda")
M = int(sys.argv[1]) if len(sys.argv) > 1 else 16
torch.manual_seed(0)
best_cfg = {}
for fam, sh in SHAPES.items():
    L = sh["L"]
    for name in ("qkv", "o", "gu", "down"):
        K, N = sh[name]
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(L)]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ys = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        part = torch.empty(8 * 16 * N, device=dev, dtype=torch.float32)
        count = torch.zeros(triton.cdiv(N, 16), device=dev, dtype=torch.int32)
        ref = F.linear(x, ws[0]).float()

        def cub():
            for w, y in zip(ws, ys):
                torch.mm(x, w.t(), out=y)
        t_cub = graph_time(cub) / L
        res = []
        for BN, BK, SPLIT, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8),
                                                              (2, 4), (3, 4)):
            if K % (BK * SPLIT) or triton.cdiv(N, BN) * SPLIT < 16 or triton.cdiv(N, BN) * SPLIT > 2000:
                continue
            try:
                triton_linear(x, ws[0], ys[0], part, count, BN, BK, SPLIT, warps, stages)
                err = (ys[0].float() - ref).abs().max().item()
                if err > 0.05:
                    print("BAD", fam, name, BN, BK, SPLIT, err); continue

                def tri():
                    for w, y in zip(ws, ys):
                        triton_linear(x, w, y, part, count, BN, BK, SPLIT, warps, stages)
                res.append((graph_time(tri) / L, BN, BK, SPLIT, warps, stages))
            except Exception as e:
                print("ERR", fam, name, BN, BK, SPLIT, warps, stages, type(e).__name__, str(e)[:100])
        res.sort()
        by = N * K * 2
        print(f"{fam} {name} K={K} N={N} M={M}: cuBLAS {t_cub:.2f} us ({by / t_cub / 1e6:.2f} TB/s); "
              f"triton best {res[0][0]:.2f} us ({by / res[0][0] / 1e6:.2f} TB/s) cfg {res[0][1:]}; next "
              + "; ".join(f"{r[0]:.2f} {r[1:]}" for r in res[1:5]), flush=True)
        best_cfg[(fam, name)] = res[0][1:]
print(best_cfg)
