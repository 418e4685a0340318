"""Does prefetching a decoding step's weights into L2 on a side stream speed its 16-row GEMMs? A stand-in for the
layers of a Qwen2.5-0.5B (or SmolLM2-135M) decoding step: per layer q|k|v, a small op, o + residual, gate|up,
SiLU·mul, down + residual, all cuBLAS and torch, captured as one CUDA graph over the real number of layers with
distinct weights. Variants: no prefetch; a side-stream prefetch of GEMM j's weight when GEMM j - D starts (D the
lookahead), by per-line `prefetch.global.L2` or by TMA bulk prefetches."""
import sys
import torch, triton, triton.language as tl
import torch.nn.functional as F


@triton.jit
def _pf_lines(w_ptr, nlines, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.minimum(i, nlines - 1)
    addr = w_ptr + i.to(tl.int64) * 64
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pf_bulk(w_ptr, nchunks, last, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = tl.minimum(i.to(tl.int64) * 8192, last)  # 16 KiB chunks of bf16
    start = tl.where(i < nchunks, start, last)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;", "=r,l",
                              [w_ptr + start], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w, kind):
    if kind == "lines":
        n = w.numel() // 64
        _pf_lines[(triton.cdiv(n, 1024),)](w, n, BLOCK=1024, num_warps=8)
    else:
        n = triton.cdiv(w.numel(), 8192)
        _pf_bulk[(triton.cdiv(n, 128),)](w, n, w.numel() - 8192, BLOCK=128, num_warps=4)


SH = {"qwen": (24, 896, 1152, 4864), "smol": (30, 576, 960, 1536)}
dev = torch.device("cuda")
M = 16
for fam, (L, H, QKV, I) in SH.items():
    torch.manual_seed(0)
    mk = lambda n, k: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    layers = [dict(qkv=mk(QKV, H), o=mk(H, H), gu=mk(2 * I, H), down=mk(H, I)) for _ in range(L)]
    order = [(i, n) for i in range(L) for n in ("qkv", "o", "gu", "down")]
    x0 = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    byts = sum(w.numel() * 2 for l in layers for w in l.values())

    def step(D, kind):
        x = x0.clone()
        starts = {}
        ev_pf = []
        cur = torch.cuda.current_stream()
        def gemm(j, a):
            i, n = order[j]
            if D and j + D < len(order):
                e = torch.cuda.Event(); e.record(cur)
                with torch.cuda.stream(side):
                    side.wait_event(e)
                    prefetch(layers[order[j + D][0]][order[j + D][1]], kind)
            return F.linear(a, layers[i][n])
        if D:
            e = torch.cuda.Event(); e.record(cur)
            with torch.cuda.stream(side):
                side.wait_event(e)
                for j in range(D):
                    prefetch(layers[order[j][0]][order[j][1]], kind)
        j = 0
        for i in range(L):
            q = gemm(j, x); j += 1
            a = q[:, :H] * 0.5 + 0.1
            x = x + gemm(j, a); j += 1
            g, u = gemm(j, x).chunk(2, -1); j += 1
            x = x + gemm(j, F.silu(g) * u); j += 1
        if D:
            cur.wait_stream(side)
        return x

    for D, kind in ((0, None), (1, "lines"), (2, "lines"), (3, "lines"), (1, "bulk"), (2, "bulk"), (3, "bulk"), (0, None)):
        try:
            step(D, kind); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step(D, kind)
            g.replay(); torch.cuda.synchronize()
            best = 1e9
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    g.replay()
                b.record(); torch.cuda.synchronize()
                best = min(best, a.elapsed_time(b) / 20)
            print(f"{fam} L={L} lookahead {D} {kind}: {best * 1e3:.1f} us a step, {best * 1e3 / L:.2f} us a layer; "
                  f"weights {byts / 1e6:.0f} MB, bound {byts / 3.0e12 * 1e6:.0f} us", flush=True)
        except Exception as e:
            print(f"{fam} lookahead {D} {kind}: {type(e).__name__}: {str(e)[:300]}", flush=True)
