"""A decoding step's RoPE and KV-cache write in one Triton program per row: q and k rotated as
kernels/rope.py rotates them, q written out, k and v written straight into the static cache's slot.

References: Su et al. 2021 "RoFormer"; kernels/rope.py (the same rotation, operation for operation,
so the rotated values are bit-equal to it); model/generate.py's `LayerCache` (the layout written).

For one token a row (T = 1), with x = (x1, x2) split at D/2 and cos = (c1, c2), sin = (s1, s2):

    q_out          = (q1*c1 - q2*s1,  q2*c2 + q1*s2)
    k_cache[:, at] = (k1*c1 - k2*s1,  k2*c2 + k1*s2)
    v_cache[:, at] = v

With Qwen3's and Gemma 3's head norms (qk_norm), each q and k head is first RMSNorm(head) with q_norm's
or k_norm's weight, rounded to q's dtype as the norm's output is (kernels/rms_norm.py's forward, the head's
two halves summed one after the other), which replaces two more launches.

`at` is a device tensor (the slot of a CUDA-graphed step), read by the kernel: the launch stays the same
from step to step. This replaces the rope kernel, its output copies and the two index_copy_ launches of
the cache write. Forward only: decoding runs without gradients. On Hopper a programmatic dependent launch
(kernels/decode_linear.py): it starts while the GEMM before it runs, waits for it before its first load,
and lets the attention after it start.

Reference: kernels.references.rope_into_cache_reference.
"""
import triton
import triton.language as tl

from kernels.decode_linear import _after_previous, pdl_constexprs
from kernels.references import DTYPES, check_rope_into_cache_args
from kernels.rope import _rotate_heads, launch_config


@triton.jit
def _rope_into_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_row_stride, k_row_stride, v_row_stride,  # [B, H, D], each row's heads contiguous
    q_out_ptr,  # [B, HQ, D] contiguous
    k_cache_ptr, v_cache_ptr, at_ptr,  # [B, HK, S, D] contiguous; at: the slot, int64 [1]
    cos_ptr, sin_ptr, cs_row_stride,  # [B, D], last dim contiguous
    qn_ptr, kn_ptr, eps, offset,  # q_norm's and k_norm's weights [D] (QK_NORM)
    S, HQ, HK, HALF,
    QK_NORM: tl.constexpr, GEMMA_CAST: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    _after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    D = 2 * HALF
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * cs_row_stride
    c1 = tl.load(cos_ptr + cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    slot = b * HK * S * D + tl.load(at_ptr) * D  # this row's head 0 at the slot
    _rotate_heads(q_ptr + b * q_row_stride, q_out_ptr + b * HQ * D, D, HQ, HALF, c1, c2, s1, s2, qn_ptr, eps, offset,
                  QK_NORM, GEMMA_CAST, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + b * k_row_stride, k_cache_ptr + slot, S * D, HK, HALF, c1, c2, s1, s2, kn_ptr, eps, offset,
                  QK_NORM, GEMMA_CAST, BLOCK_HK, BLOCK_HALF)
    h = tl.arange(0, BLOCK_HK)[:, None]
    e = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    mask = (h < HK) & (e < D)
    v = tl.load(v_ptr + b * v_row_stride + h * D + e, mask=mask, other=0.0)
    tl.store(v_cache_ptr + slot + h * (S * D) + e, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x):
    """x [B, 1, H, D] as [B, H, D] and the distance between its rows, in elements: read in place where each row's
    heads are contiguous (a column slice of the packed q | k | v projection), else copied."""
    B, _, H, D = x.shape
    if x.stride(3) == 1 and x.stride(2) == D:
        return x[:, 0], x.stride(0)
    return x[:, 0].contiguous(), H * D


def rope_into_cache(q, k, v, cos, sin, k_cache, v_cache, at, qk_norm=None, eps=1e-6, offset=0.0, cast="llama"):
    """Rotate q [B, 1, Hq, D] and k [B, 1, Hk, D] by cos, sin [B or 1, 1, D]; write k and v [B, 1, Hk, D] into
    k_cache, v_cache [B, Hk, S, D] at slot at[0] (at: int64 [1] on the device). Returns the rotated q [B, 1, Hq, D],
    contiguous. qk_norm: (q_norm's weight, k_norm's weight), each [D] in q's dtype: each q and k head is normalized
    first (eps, offset, cast: kernels/rms_norm.py's)."""
    check_rope_into_cache_args(q, k, v, cos, sin, k_cache, v_cache, at, qk_norm, cast)
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache)):
        assert t.dtype in DTYPES, f"rope_into_cache: {name} must be fp32/bf16/fp16, got {t.dtype}"
    B, _, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    (q, q_stride), (k, k_stride), (v, v_stride) = _rows(q), _rows(k), _rows(v)
    cos, sin = cos.expand(B, 1, D)[:, 0], sin.expand(B, 1, D)[:, 0]
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = q.new_empty(B, Hq, D)
    q_norm, k_norm = (cos, cos) if qk_norm is None else qk_norm  # unread without QK_NORM
    if B > 0:
        block_hq, block_hk, block_half, num_warps = launch_config(Hq, Hk, D)
        _rope_into_cache_kernel[(B,)](
            q, k, v, q_stride, k_stride, v_stride, q_out, k_cache, v_cache, at, cos, sin, cos.stride(0),
            q_norm, k_norm, eps, offset, S, Hq, Hk, D // 2, QK_NORM=qk_norm is not None, GEMMA_CAST=cast == "gemma",
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=num_warps, **pdl_constexprs(q))
    assert q_out.dtype == q.dtype, "rope_into_cache: q_out must keep q's dtype"
    return q_out[:, None]
