"""gate | up in place: a GroupSampler rollout of Qwen2.5-0.5B (2 prompts x 8, 64 tokens, median of 9) with the
decoding SwiGLU GEMM swapped for variants (swi.py's kernel, no split-K: Qwen's 152 tiles need none): the tree's;
the same kernel; without dependent launch; without the L2 prefetch; with the norm weight as a tile; without the
norm (wrong values, right bytes). Alternating twice."""
import argparse, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
import model.decode as md
from kernels.decode_linear import _after_previous, _prefetch_rows, _rstd
from kernels.rms_norm import _normalized


@triton.jit
def swi(x_ptr, nw_ptr, w_ptr, h_ptr, M, N, K, eps,
        NORM: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        _prefetch_rows(w_ptr, cols, cols < N, K, 0, K, BLOCK_K)
        _prefetch_rows(w_ptr, N + cols, cols < N, K, 0, K, BLOCK_K)
    _after_previous(PDL)
    if NORM == 1 or NORM == 3:
        rstd = _rstd(x_ptr, rows, M, K, eps, BLOCK_M, BLOCK_K)
    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xm = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=xm, other=0.0)
        if NORM == 1:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = _normalized(x.to(tl.float32), nw[None, :], rstd[:, None], 0.0, x_ptr, nw_ptr, False).to(
                x_ptr.dtype.element_ty)
        if NORM == 3:
            nw = tl.load(nw_ptr + ks[None, :] + 0 * rows[:, None], mask=xm, other=0.0).to(tl.float32)
            x = _normalized(x.to(tl.float32), nw, rstd[:, None], 0.0, x_ptr, nw_ptr, False).to(
                x_ptr.dtype.element_ty)
        if NORM == 2:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * nw[None, :]).to(x_ptr.dtype.element_ty)
        wm = (cols[:, None] < N) & (ks[None, :] < K)
        w1 = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=wm, other=0.0)
        w2 = tl.load(w_ptr + (N + cols[:, None]) * K + ks[None, :], mask=wm, other=0.0)
        if SWAP:
            acc_g = tl.dot(w1, tl.trans(x), acc_g)
            acc_u = tl.dot(w2, tl.trans(x), acc_u)
        else:
            acc_g = tl.dot(x, tl.trans(w1), acc_g)
            acc_u = tl.dot(x, tl.trans(w2), acc_u)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if NORM == 2:
        ssq = tl.zeros([BLOCK_M], tl.float32)
        rs = _rstd(x_ptr, rows, M, K, eps, BLOCK_M, BLOCK_K)
        acc_g = acc_g * rs[:, None]
        acc_u = acc_u * rs[:, None]
    g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)



p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
a = p.parse_args()
dev = torch.device("cuda")
ns = argparse.Namespace(model=None, shape="qwen2.5-0.5b", smoke=False, cache_dir=a.cache_dir)
folder = model_folder(ns)
cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                         beta=None, loss_type="dapo", num_iterations=1), "cuda")
model, mcfg = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
real = md.decode_swiglu


def variant(norm, pdl, prefetch):
    def fn(x, nw, w, b, ws, eps=1e-6, offset=0.0, cast="llama", block_n=32):
        M, K = x.shape
        N = w.shape[0] // 2
        h = x.new_empty(M, N)
        swi[(triton.cdiv(N, block_n),)](x, nw, w, h, M, N, K, eps, NORM=norm, SWAP=False, PDL=pdl,
                                        PREFETCH=prefetch, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128,
                                        launch_pdl=pdl, num_warps=4, num_stages=4)
        return h
    return fn


VARIANTS = {"tree": real, "same kernel": variant(1, True, True), "no PDL": variant(1, False, False),
            "no prefetch": variant(1, True, False), "norm weight as a tile": variant(3, True, True),
            "no norm (wrong values)": variant(0, True, True)}
ref = None
for r in (1, 2):
    for name, fn in VARIANTS.items():
        md.decode_swiglu = fn
        s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                         cuda_graph=True)
        g = torch.Generator(dev).manual_seed(0)
        for _ in range(3):
            out = s(prompts, 8, 0.0, generator=g)
        ts = []
        for _ in range(9):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        ref = ref or out[0]
        same = sum(x == y for x, y in zip(out[0], ref))
        print(f"{r} {name}: rollout {sorted(ts)[4] * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}); greedy rows equal to "
              f"the tree's: {same}/16", flush=True)
        del s
