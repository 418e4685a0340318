"""Attention of one query a row over a static KV cache, read in place: one Triton program per (row,
query head), reading the kv head that query head reads (grouped-query attention without repeating k and v).
A program per kv head, for all rep = Hq / Hk query heads of it, would read each k and v once, but gives the GPU
only B · Hk programs (32 for 16 rows of Qwen2.5-0.5B) with rep × more products each: the step's slowest kernel.

References: Milakov & Gimelshein 2018 "Online normalizer calculation for softmax" and Dao et al.
2022 "FlashAttention" (the running max and sum); Gemma 2's attention logit softcapping; model/
transformer.py's `attend` (the path this replaces on a decoding step) and model/generate.py's
`KVCache.mask` (which slots a row sees).

Row b's query at slot `at` sees the slots j with lo <= j <= at, lo = first[b] (its first slot that
holds its own tokens; 0 without `first`), raised to at - window + 1 on a sliding-window layer. For
query head i of kv head h, in fp32:

    s_j = scale · q_i · k_j                 (with a softcap c: s_j = c · tanh(s_j / c))
    y_i = Σ_j exp(s_j - m) v_j / Σ_j exp(s_j - m),   m = max_j s_j

over blocks of BLOCK_S slots (`launch_config`) with the running max and sum, and y_i is rounded once, at the store.
Only the visible slots are read; `first` and `at` are device tensors, so a CUDA graph of the step
replays at every position. The rounding differs from SDPA's kernels (which round the probabilities
before the product with v): the tests compare both with a float64 reference. Forward only.

Reference: kernels.references.decode_attention_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, check_decode_attention_args
from kernels.tanh import tanh

NUM_WARPS = 4


def launch_config(rep: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_REP, BLOCK_S, BLOCK_D): a program takes BLOCK_REP of a kv head's rep query heads (one), and a step
    of its loop holds the (BLOCK_REP, BLOCK_S, BLOCK_D) products of q and k in registers, about 8192 of them (64 a
    thread), so the slots a step reads shrink as the head grows: 128 at D 64, 32 at D 256."""
    block_rep, block_d = 1, triton.next_power_of_2(D)
    return block_rep, max(2, min(128, 8192 // (block_rep * block_d))), block_d


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, HQ, D] contiguous
    k_ptr, v_ptr,  # [B, HK, S, D] contiguous
    y_ptr,  # [B, HQ, D] contiguous
    first_ptr, at_ptr,  # int64 [B] (if HAS_FIRST), int64 [1]
    S, HK, D, window, scale, softcap,
    REP: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_REP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64) * BLOCK_REP + tl.arange(0, BLOCK_REP)[:, None]  # query heads of kv head h
    d = tl.arange(0, BLOCK_D)[None, :]
    qmask = (r < REP) & (d < D)
    q_offs = (b * HK * REP + h * REP + r) * D + d  # (BLOCK_REP, BLOCK_D)
    q = tl.load(q_ptr + q_offs, mask=qmask, other=0.0).to(tl.float32)
    at = tl.load(at_ptr)
    lo = tl.load(first_ptr + b) if HAS_FIRST else at * 0
    if HAS_WINDOW:
        lo = tl.maximum(lo, at - window + 1)
    kv = k_ptr + (b * HK + h) * S * D
    vv = v_ptr + (b * HK + h) * S * D
    m = tl.full([BLOCK_REP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_REP], tl.float32)  # noqa: E741 (the softmax's running sum, as the papers name it)
    acc = tl.zeros([BLOCK_REP, BLOCK_D], tl.float32)
    j = tl.arange(0, BLOCK_S)
    for start in range(lo, at + 1, BLOCK_S):
        slots = start + j  # (BLOCK_S,)
        smask = slots <= at
        kv_mask = smask[:, None] & (d < D)
        k = tl.load(kv + slots[:, None] * D + d, mask=kv_mask, other=0.0).to(tl.float32)  # (BLOCK_S, BLOCK_D)
        v = tl.load(vv + slots[:, None] * D + d, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BLOCK_REP, BLOCK_S)
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        s = tl.where(smask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    y = acc / l[:, None]
    tl.store(y_ptr + q_offs, y.to(y_ptr.dtype.element_ty), mask=qmask)


def decode_attention(q, k_cache, v_cache, first, at, scale, window=None, softcap=None):
    """y [B, 1, Hq, D], q's dtype: q [B, 1, Hq, D] attending over k_cache, v_cache [B, Hk, S, D] at slot at[0]
    (int64 [1]), each row from its slot first[b] (int64 [B]; None: slot 0), within `window` slots (None: all)."""
    check_decode_attention_args(q, k_cache, v_cache, first, at)
    assert q.dtype in DTYPES and k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    B, _, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    y = torch.empty_like(q)
    rep = Hq // Hk
    if B > 0:
        block_rep, block_s, block_d = launch_config(rep, D)
        _decode_attention_kernel[(B, Hk, triton.cdiv(rep, block_rep))](
            q, k_cache, v_cache, y, at if first is None else first, at, S, Hk, D,
            0 if window is None else window, scale, 1.0 if softcap is None else softcap,
            REP=rep, HAS_FIRST=first is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            BLOCK_REP=block_rep, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=NUM_WARPS)
    assert y.dtype == q.dtype, f"decode_attention: y must be {q.dtype}, got {y.dtype}"
    return y
