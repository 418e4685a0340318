"""Attention kernels for one layer, fwd + bwd, bf16, on the GPU (triton's do_bench): FlexAttention with
a document mask against flash attention's variable-length kernels (aten._flash_attention_forward with
cu_seqlens; grid sized by the row length, by the longest document, and with the count of documents
padded to a power of two), with their largest differences and FlexAttention's first-call (compile)
time; then plain causal rows through SDPA's flash, cuDNN and memory-efficient kernels.

    python scripts/bench/probe_attention.py            # the tables of docs/perf-notes.md

The variable-length kernels under CUDA graphs are tested in the model's step (tests/test_step.py).
"""
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `model`
from model.transformer import Documents, _VarlenAttention  # noqa: E402

flex = torch.compile(flex_attention, dynamic=False)
dev = "cuda"


def docs_for(B, T, lo, hi, rng):
    doc_ids, lengths = [], []
    for _ in range(B):
        row, d = [], 0
        while len(row) < T:
            n = min(rng.randint(lo, hi), T - len(row))
            row += [d] * n
            lengths.append(n)
            d += 1
        doc_ids.append(row)
    return torch.tensor(doc_ids, device=dev), lengths


def cu_of(lengths, cap=None):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if cap:
        cu += [cu[-1]] * (cap + 1 - len(cu))
    return torch.tensor(cu, dtype=torch.int32, device=dev)


def bench(fn, params):
    return do_bench(fn, warmup=25, rep=150, grad_to_none=params, return_mode="median")


def case(name, B, T, Hq, Hk, D, lo, hi, seed=0):
    rng = random.Random(seed)
    doc_ids, lengths = docs_for(B, T, lo, hi, rng)
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)

    def keep(b, h, qi, kv):
        return (kv <= qi) & (doc_ids[b, qi] == doc_ids[b, kv])

    t0 = time.perf_counter()
    bm = create_block_mask(keep, B, None, T, T, device=dev)
    torch.cuda.synchronize()
    t_mask = time.perf_counter() - t0

    def f_flex():
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale,
                 enable_gqa=True).transpose(1, 2)
        o.backward(dout)
        return o

    t0 = time.perf_counter()
    o_flex = f_flex()
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    gq, gk, gv = q.grad.clone(), k.grad.clone(), v.grad.clone()
    q.grad = k.grad = v.grad = None

    cu = cu_of(lengths)
    cap = 1 << (len(lengths) - 1).bit_length()
    cu_pad = cu_of(lengths, cap)
    maxdoc = max(lengths)

    def f_var(cu_, m):
        def f():
            o = _VarlenAttention.apply(q.view(B * T, Hq, D), k.view(B * T, Hk, D), v.view(B * T, Hk, D),
                                       Documents(cu_, m), scale, None)
            o.backward(dout.view(B * T, Hq, D))
            return o.view(B, T, Hq, D)
        return f

    o_var = f_var(cu_pad, T)()
    torch.cuda.synchronize()
    diffs = [(o_var - o_flex).abs().max().item(), (q.grad - gq).abs().max().item(),
             (k.grad - gk).abs().max().item(), (v.grad - gv).abs().max().item()]
    q.grad = k.grad = v.grad = None
    p = [q, k, v]
    r = {
        "flex": bench(f_flex, p),
        "varlen max=T": bench(f_var(cu, T), p),
        "varlen max=maxdoc": bench(f_var(cu, maxdoc), p),
        f"varlen padded cu ({len(lengths)}->{cap}) max=T": bench(f_var(cu_pad, T), p),
    }
    print(f"{name} B{B} T{T} Hq{Hq} Hk{Hk} D{D} docs {len(lengths)} (len {lo}-{hi}, max {maxdoc}) |"
          f" mask {t_mask*1e3:.0f} ms,"
          f" flex first call {t_first:.2f} s | diff vs flex out/dq/dk/dv {[f'{d:.3g}' for d in diffs]}", flush=True)
    for k_, v_ in r.items():
        print(f"   {k_}: {v_:.3f} ms", flush=True)


def causal(name, B, T, Hq, Hk, D):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    out = {}
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def f(be=be):
            with sdpa_kernel([be]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(dout)
        try:
            out[be.name] = f"{bench(f, [q, k, v]):.3f} ms"
        except Exception as e:
            out[be.name] = f"failed {type(e).__name__}: {str(e)[:100]}"

    def fv():
        o = _VarlenAttention.apply(q.transpose(1, 2).reshape(B * T, Hq, D), k.transpose(1, 2).reshape(B * T, Hk, D),
                                   v.transpose(1, 2).reshape(B * T, Hk, D),
                                   Documents(torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev), T),
                                   D ** -0.5, None)
        o.backward(dout.transpose(1, 2).reshape(B * T, Hq, D))
    out["varlen (B docs)"] = f"{bench(fv, [q, k, v]):.3f} ms"
    print(f"causal {name} B{B} T{T}: {out}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("error: probe_attention.py needs a CUDA GPU")
    print(torch.__version__, torch.cuda.get_device_name())
    case("tinyllama", 4, 2048, 32, 4, 64, 20, 120)
    case("tinyllama", 4, 2048, 32, 4, 64, 100, 1000)
    case("smollm2", 4, 2048, 9, 3, 64, 20, 120)
    case("smollm2", 8, 512, 9, 3, 64, 20, 120)
    case("qwen0.5b", 4, 2048, 14, 2, 64, 100, 1000)
    for args in (("tinyllama", 4, 2048, 32, 4, 64), ("qwen0.5b", 4, 2048, 14, 2, 64), ("smollm2", 8, 512, 9, 3, 64),
                 ("tinyllama", 1, 64, 32, 4, 64)):
        causal(*args)
