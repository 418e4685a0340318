"""A decoding step's attention input: RMSNorm in the prologue of the q | k | v GEMM, and the bias, RoPE and the
KV-cache write in its epilogue: one launch where a norm, a GEMM and kernels/rope_cache.py ran.

References: kernels/decode_linear.py (the skinny GEMM, its split-K and its norm prologue); kernels/rope_cache.py
(RoPE and the cache write, operation for operation); Su et al. 2021 "RoFormer"; Hugging Face LlamaAttention.

A program owns one head of the packed projection (W [(Hq + 2 Hk) · D, K]: Hq q heads, Hk k heads, Hk v heads, the
layout `pack_weights_` stores), as two dots: the head's first D/2 columns and its last D/2, so that RoPE's
rotate-half pairs (d, d + D/2) sit in one program. For rows x [M, K]:

    x̂      = RMSNorm(x)                                   each program computes the rms of the M rows itself
    y1, y2 = round(x̂ W[h·D + d]ᵀ + b),  round(x̂ W[h·D + D/2 + d]ᵀ + b)     d < D/2; fp32 sums, split-K as in
                                                                          decode_linear
    (QK_NORM, Qwen3: a q or k head's (y1, y2) = RMSNorm over its D values, with q_norm's or k_norm's weight)
    q head:   q_out[:, h]          = (y1 c1 - y2 s1,  y2 c2 + y1 s2)      cos = (c1, c2), sin = (s1, s2) per row
    k head:   k_cache[:, h', at]   = (y1 c1 - y2 s1,  y2 c2 + y1 s2)
    v head:   v_cache[:, h', at]   = (y1, y2)

y1, y2 are rounded to x's dtype as the GEMM's output is before RoPE reads it (and before the head's norm, whose
output is rounded as kernels/rms_norm.py rounds it); the rotated values are rounded once, at the store. Given x's
`Scaled` rows (written by the previous layer's down projection, kernels/decode_linear.py), the loop multiplies xs
as it is and the sums are scaled by rstd (from ss) before the bias; with sandwich norms (Gemma 2/3) x arrives as a
`Sandwich` of the residual stream and the previous layer's down output, as in kernels/decode_swiglu.py. `at` is a
device tensor (a CUDA-graphed step's slot). Forward only.

Reference: kernels.references.decode_qkv_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_linear import (
    NUM_WARPS,
    Workspace,
    _after_previous,
    _norm_stats,
    _normed_pair,
    _prefetch_rows,
    _sandwich_rstd,
    _scaled_pair,
    _sum_pair,
    block_m,
    dot_constexprs,
    input_args,
    launch_config,
    num_stages,
    pdl_constexprs,
    scaled_input,
)
from kernels.references import DTYPES, check_norm_linear_args
from kernels.rms_norm import _normalized


@triton.jit
def _decode_qkv_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr,  # x [M, K]; nw [K]; w [(HQ + 2 HK) D, K]; b [(HQ + 2 HK) D]: contiguous
    cos_ptr, sin_ptr,  # [M, D] contiguous
    q_ptr, k_cache_ptr, v_cache_ptr, at_ptr,  # q [M, HQ, D]; caches [M, HK, S, D]; at: the slot, int64 [1]
    qn_ptr, kn_ptr,  # q_norm's and k_norm's weights [D] (QK_NORM)
    ss_ptr,  # a `Scaled` x's sums of squares [T, M] fp32 (NORMALIZE False)
    zs_ptr, zss_ptr, xo_ptr,  # a `Sandwich`'s z rows [M, K], their sums of squares [TZ, M] fp32 and out [M, K]
    ws_ptr, count_ptr,  # fp32 [SPLIT, 2 · heads, BLOCK_M, BLOCK_HALF]; int32 [heads], zeros
    M, K, K_CHUNK, S, HQ, HK, HALF, T, TZ, eps, offset,
    NORMALIZE: tl.constexpr, T_STEPS: tl.constexpr, SANDWICH: tl.constexpr, TZ_STEPS: tl.constexpr,
    GEMMA_CAST: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, SPLIT: tl.constexpr,
    DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    head = tl.program_id(0)  # q heads, then k heads, then v heads
    split = tl.program_id(1)
    D = 2 * HALF
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_HALF)
    n1 = head * D + d  # the head's first half of columns; n1 + HALF its second
    dmask = d < HALF
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    if PDL:  # the weight rows on their way to L2 while the previous kernel runs
        _prefetch_rows(w_ptr, n1, dmask, K, k_lo, k_hi, BLOCK_K)
        _prefetch_rows(w_ptr, n1 + HALF, dmask, K, k_lo, k_hi, BLOCK_K)
    _after_previous(PDL)
    # the epilogue's inputs, loaded before the GEMM so that the head's last program does not wait for them after it
    mask = (rows[:, None] < M) & dmask[None, :]
    cs = rows[:, None] * D + d[None, :]
    c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b1 = tl.load(b_ptr + n1, mask=dmask, other=0.0).to(tl.float32)
        b2 = tl.load(b_ptr + n1 + HALF, mask=dmask, other=0.0).to(tl.float32)
    if QK_NORM:  # the head's norm weight: q_norm's for a q head, k_norm's for a k head (v heads: unused)
        n_ptr = tl.where(head < HQ, qn_ptr, kn_ptr)
        nw1 = tl.load(n_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        nw2 = tl.load(n_ptr + d + HALF, mask=dmask, other=0.0).to(tl.float32)
    at = tl.load(at_ptr)
    zrstd = _sandwich_rstd(zss_ptr, rows, M, K, TZ, eps, SANDWICH, BLOCK_M, TZ_STEPS)
    stats = _norm_stats(x_ptr, ss_ptr, zs_ptr, zrstd, xo_ptr, (head == 0) & (split == 0), rows, M, K, T, eps,
                        NORMALIZE, SANDWICH, BLOCK_M, BLOCK_K, T_STEPS)
    acc1, acc2 = _normed_pair(x_ptr, nw_ptr, w_ptr, zs_ptr, zrstd, rows, M, K, k_lo, k_hi, stats, offset, n1,
                              n1 + HALF, dmask, NORMALIZE, SANDWICH, GEMMA_CAST, DTYPE, OPERAND, PRECISION,
                              BLOCK_M, BLOCK_HALF, BLOCK_K)
    acc1, acc2, last = _sum_pair(acc1, acc2, ws_ptr, count_ptr, head, split, SPLIT, BLOCK_M, BLOCK_HALF)
    if last:
        acc1, acc2 = _scaled_pair(acc1, acc2, stats, K, eps, NORMALIZE)
        if HAS_BIAS:
            acc1 += b1[None, :]
            acc2 += b2[None, :]
        y1 = acc1.to(q_ptr.dtype.element_ty).to(tl.float32)
        y2 = acc2.to(q_ptr.dtype.element_ty).to(tl.float32)
        col_head = head + 0 * d  # the head as a vector: the interpreter mishandles a tensor mask & a scalar one
        rotated = col_head[None, :] < HQ + HK  # q and k heads; v heads go to the cache as they are
        if QK_NORM:  # each row's RMSNorm over the head's D values (the lanes past HALF hold zeros)
            rstd = tl.rsqrt((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / D + eps)
            y1 = tl.where(rotated, _normalized(y1, nw1[None, :], rstd[:, None], offset, q_ptr, qn_ptr, GEMMA_CAST)
                          .to(q_ptr.dtype.element_ty).to(tl.float32), y1)
            y2 = tl.where(rotated, _normalized(y2, nw2[None, :], rstd[:, None], offset, q_ptr, qn_ptr, GEMMA_CAST)
                          .to(q_ptr.dtype.element_ty).to(tl.float32), y2)
        o1 = tl.where(rotated, y1 * c1 - y2 * s1, y1)
        o2 = tl.where(rotated, y2 * c2 + y1 * s2, y2)
        q_offs = rows[:, None] * (HQ * D) + head * D + d[None, :]
        is_q = mask & (col_head[None, :] < HQ)
        tl.store(q_ptr + q_offs, o1.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(q_ptr + q_offs + HALF, o2.to(q_ptr.dtype.element_ty), mask=is_q)
        kv_head = tl.where(head < HQ + HK, head - HQ, head - HQ - HK)
        slot = (rows[:, None].to(tl.int64) * HK + kv_head) * S * D + at * D + d[None, :]
        is_k = mask & rotated & (col_head[None, :] >= HQ)
        is_v = mask & (col_head[None, :] >= HQ + HK)
        tl.store(k_cache_ptr + slot, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
        tl.store(k_cache_ptr + slot + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
        tl.store(v_cache_ptr + slot, o1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
        tl.store(v_cache_ptr + slot + HALF, o2.to(v_cache_ptr.dtype.element_ty), mask=is_v)


def decode_qkv(x, norm_weight, weight, bias, cos, sin, k_cache, v_cache, at, n_heads, workspace: Workspace,
               eps=1e-6, offset=0.0, cast="llama", qk_norm=None):
    """q | k | v = RMSNorm(x) Wᵀ + b for x [M, K] (M <= 64), norm_weight [K] (offset and cast as in
    kernels/rms_norm.py), weight [(n_heads + 2 Hk) · D, K], bias or None, one dtype; q and k rotated by cos, sin
    [M, D], k and v written into k_cache, v_cache [M, Hk, S, D] at slot at[0] (int64 [1] on the device). Returns the
    rotated q [M, n_heads, D]. x may be a `Scaled` (kernels/decode_linear.py) of the rows for this norm, which the
    kernel multiplies as they are, or a `Sandwich`, whose rows r + RMSNorm(z) the kernel normalizes and writes to
    its out. qk_norm: None, or (q_norm's weight, k_norm's weight) [D] each (Qwen3), an RMSNorm
    of each q and k head before RoPE with eps, offset and cast as x's norm (a model's norms share them).
    workspace: the split-K buffers (kernels/decode_linear.py). No gradients."""
    scaled, x = x, scaled_input(x)
    check_norm_linear_args(x, norm_weight, weight, bias, cast)
    assert x.dtype in DTYPES, f"decode_qkv: fp32/bf16/fp16, got {x.dtype}"
    M, K = x.shape
    Hk, S, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = n_heads + 2 * Hk
    if weight.shape[0] != heads * D or D % 2 or cos.shape != (M, D) or sin.shape != (M, D):
        raise ValueError(f"decode_qkv: weight must be [{heads} · {D}, K] and cos, sin [{M}, {D}] (even D); got "
                         f"{tuple(weight.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != M or not (k_cache.is_contiguous() and
                                                                       v_cache.is_contiguous()):
        raise ValueError(f"decode_qkv: the caches must be contiguous [{M}, Hk, S, {D}]; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    assert k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype == x.dtype, (k_cache.dtype, cos.dtype, x.dtype)
    assert at.shape == (1,) and at.dtype == torch.int64, "decode_qkv: `at` must be one int64 slot"
    if qk_norm is not None and any(w.shape != (D,) or w.dtype != x.dtype for w in qk_norm):
        raise ValueError(f"decode_qkv: q_norm's and k_norm's weights must be [{D}] of {x.dtype}; got "
                         f"{[(tuple(w.shape), w.dtype) for w in qk_norm]}")
    q_norm, k_norm = (norm_weight, norm_weight) if qk_norm is None else qk_norm  # unread without QK_NORM
    x, weight, cos, sin = x.contiguous(), weight.contiguous(), cos.contiguous(), sin.contiguous()
    q = x.new_empty(M, n_heads, D)
    split, chunk, block_k = launch_config(heads, K, x)
    bm, half = block_m(M), max(16, triton.next_power_of_2(D // 2))
    ws, counts = workspace.get(split * 2 * heads * bm * half if split > 1 else 0, heads, x.device)
    inputs, (T, TZ), constexprs = input_args(scaled, ws)
    _decode_qkv_kernel[(heads, split)](
        x, norm_weight, weight, weight if bias is None else bias, cos, sin, q, k_cache, v_cache, at, q_norm, k_norm,
        *inputs, ws, counts, M, K, chunk, S, n_heads, Hk, D // 2, T, TZ, eps, offset, **constexprs,
        GEMMA_CAST=cast == "gemma", HAS_BIAS=bias is not None, QK_NORM=qk_norm is not None, SPLIT=split,
        **dot_constexprs(x),
        BLOCK_M=bm, BLOCK_HALF=half, BLOCK_K=block_k, **pdl_constexprs(x), num_warps=NUM_WARPS,
        num_stages=num_stages((bm + 2 * half) * block_k, x))
    assert q.dtype == x.dtype, f"decode_qkv: q must be {x.dtype}, got {q.dtype}"
    return q
