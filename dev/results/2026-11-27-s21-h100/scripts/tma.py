"""Skinny decoding GEMMs (16 rows) with the weight read through TMA (tensor descriptors) and/or with A and B
swapped (W tile as the MMA's M side, so that Hopper's wgmma takes it straight from shared memory), against the
tree's kernels and cuBLAS. Each case: one CUDA graph of L launches over L distinct weights (cold L2), replayed;
µs a launch and the weight's TB/s."""
import itertools
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.decode_linear import Workspace, decode_linear
from kernels.decode_swiglu import decode_swiglu


@triton.jit
def gemm(w_desc, w_ptr, x_ptr, y_ptr, M, N, K, K_CHUNK,
         SWAP: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n0 = tile * BLOCK_N
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                    other=0.0)
        if TMA:
            w = w_desc.load([n0, k0])
        else:
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                        other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        ptrs = y_ptr + rows[None, :] * N + cols[:, None]
        mask = (rows[None, :] < M) & (cols[:, None] < N)
    else:
        ptrs = y_ptr + rows[:, None] * N + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT > 1:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton.set_allocator(alloc)
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def make_case(x, w, bn, bk, stages, warps, swap, tma, split):
    M, K = x.shape
    N = w.shape[0]
    tiles = triton.cdiv(N, bn)
    blocks = triton.cdiv(K, bk)
    if split == 0:  # about one wave
        split = max(1, min(blocks, triton.cdiv(SMS, tiles)))
    chunk = triton.cdiv(blocks, split) * bk
    split = triton.cdiv(K, chunk)
    y = torch.zeros(M, N, device="cuda", dtype=torch.float32 if split > 1 else x.dtype)
    desc = TensorDescriptor.from_tensor(w, [bn, bk])

    def fn():
        if split > 1:
            y.zero_()
        gemm[(tiles, split)](desc, w, x, y, M, N, K, chunk, SWAP=swap, TMA=tma, SPLIT=split, BLOCK_M=16,
                             BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return fn, y, split


def timed(fns, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    return min(best)


SHAPES = {  # name: (N, K, layers)
    "qwen gate|up": (9728, 896, 24), "qwen down": (896, 4864, 24), "qwen q|k|v": (1152, 896, 24),
    "qwen o": (896, 896, 24),
    "smol gate|up": (3072, 576, 30), "smol down": (576, 1536, 30), "smol q|k|v": (960, 576, 30),
}
only = sys.argv[1:] or list(SHAPES)
torch.manual_seed(0)
for name in only:
    N, K, L = SHAPES[name]
    xs = [torch.randn(16, K, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(L)]
    mb = N * K * 2 / 1e6
    ref = [x.float() @ w.float().t() for x, w in zip(xs, ws)]
    res = []
    t = timed([lambda x=x, w=w: torch.mm(x, w.t()) for x, w in zip(xs, ws)])
    res.append((t, "cublas"))
    wsp = Workspace()
    if "gate|up" in name:
        nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
        t = timed([lambda x=x, w=w: decode_swiglu(x, nw, w, None, wsp) for x, w in zip(xs, ws)])
        res.append((t, "tree decode_swiglu (norm+swiglu, PDL)"))
    else:
        r = torch.zeros(16, N, device="cuda", dtype=torch.bfloat16)
        t = timed([lambda x=x, w=w: decode_linear(x, w, None, r, wsp) for x, w in zip(xs, ws)])
        res.append((t, "tree decode_linear (residual, PDL)"))
    for bn, bk, stages, swap, tma, split in itertools.product((32, 64, 128), (128, 256), (4, 6), (False, True),
                                                              (False, True), (0,)):
        if bk * 2 * bn * stages > 200 * 1024:
            continue
        if swap and bn < 64 and tma:
            pass
        try:
            cases = [make_case(x, w, bn, bk, stages, 4, swap, tma, split) for x, w in zip(xs, ws)]
            t = timed([c[0] for c in cases])
            err = max(float((c[1].float() - r_).abs().max()) for c, r_ in zip(cases[:2], ref[:2]))
            res.append((t, f"bn {bn} bk {bk} st {stages} swap {int(swap)} tma {int(tma)} split {cases[0][2]} "
                           f"err {err:.3f}"))
        except Exception as e:
            res.append((1e9, f"bn {bn} bk {bk} st {stages} swap {int(swap)} tma {int(tma)}: {type(e).__name__} "
                             f"{str(e)[:120]}"))
    res.sort()
    print(f"== {name}: N {N} K {K}, {mb:.2f} MB a weight, {L} weights", flush=True)
    for t, what in res[:14]:
        print(f"  {t:7.2f} us  {mb / t:5.2f} TB/s  {what}")
    for t, what in res:
        if what.startswith("cublas") or what.startswith("tree"):
            print(f"  [{t:7.2f} us  {mb / t:5.2f} TB/s  {what}]")
    bad = [w for t, w in res if t >= 1e9]
    if bad:
        print("  failed:", bad[:3])
