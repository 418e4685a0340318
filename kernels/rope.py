"""Rotary position embedding (RoPE) of q and k, HF "rotate half" layout, one Triton
program per token (all q and k heads of that token).

References: Su et al. 2021 "RoFormer"; Hugging Face `apply_rotary_pos_emb` and
`rotate_half` (modeling_llama.py); Liger-Kernel `ops/rope.py`.

With x = (x1, x2) split at D/2, cos = (c1, c2), sin = (s1, s2) (HF: c1 == c2, s1 == s2,
but the kernel reads both halves), and R = rotate_half, R(x) = (-x2, x1):

    out = x * cos + R(x) * sin  =  (x1*c1 - x2*s1,  x2*c2 + x1*s2)

R is linear with R^T = -R, so

    dx = dout * cos + R^T(dout * sin) = dout * cos - R(dout * sin)
       = (d1*c1 + d2*s2,  d2*c2 - d1*s1)

which is the forward map with (s1, s2) replaced by (-s2, -s1): the same kernel with
BACKWARD=True. cos and sin are per-token tables [B, T, D] (batch may broadcast), so any
position ids work, packed rows restarting at 0 included. They get no gradient.

Where q and k are column slices of one projection output q | k | v (the fused LoRA path), `apply_rope_qkv`
takes that tensor whole and returns v beside the rotated q and k: its backward writes dq and dk straight
into the column slices of one d(q | k | v) tensor and copies dv beside them, where autograd's split would
concatenate three separate gradients in a pass of its own (a read and a write of the whole tensor). The same
programs copy v forward (the contiguous copy attention saves) and dv backward.

Reference: kernels.references.rope_reference (and rope_qkv_reference).
"""
import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, check_rope_args, check_rope_qkv_args, qkv_heads
from kernels.rms_norm import _normalized


@triton.jit
def _rotate_heads(x_ptr, out_ptr, out_head_stride, n_heads, HALF, c1, c2, s1, s2, w_ptr, eps, offset,
                  NORM: tl.constexpr, GEMMA_CAST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the n_heads contiguous heads of one token ([n_heads, 2*HALF] at x_ptr) into heads out_head_stride
    apart at out_ptr (2*HALF: contiguous as they came; kernels/rope_cache.py: a KV cache's slots). NORM: each head
    is first normalized over its 2*HALF values with the weight at w_ptr (kernels/rms_norm.py's forward, its two
    halves summed one after the other) and rounded to x's dtype, as the norm's output is (Qwen3's and Gemma 3's
    q_norm and k_norm)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < HALF)
    offs = h * (2 * HALF) + d
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + d + HALF, mask=d < HALF, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = _normalized(x1, w1, rstd, offset, x_ptr, w_ptr, GEMMA_CAST).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = _normalized(x2, w2, rstd, offset, x_ptr, w_ptr, GEMMA_CAST).to(x_ptr.dtype.element_ty).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    out = h * out_head_stride + d
    tl.store(out_ptr + out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_token_stride, k_token_stride,  # [B*T, H, D], each token's heads contiguous
    q_out_ptr, k_out_ptr, q_out_token_stride, k_out_token_stride,  # [B*T, H, D], each token's heads contiguous
    cos_ptr, sin_ptr, cs_batch_stride, cs_token_stride,  # [B, T, D], last dim contiguous
    v_ptr, v_token_stride, v_out_ptr, v_out_token_stride,  # [B*T, HK, D], each token's heads contiguous (COPY_V)
    T, HQ, HK, HALF,
    BACKWARD: tl.constexpr, COPY_V: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    b = token // T
    t = token % T
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cs = b * cs_batch_stride + t * cs_token_stride
    c1 = tl.load(cos_ptr + cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1
    q_in, q_out = q_ptr + token * q_token_stride, q_out_ptr + token * q_out_token_stride
    k_in, k_out = k_ptr + token * k_token_stride, k_out_ptr + token * k_out_token_stride
    _rotate_heads(q_in, q_out, 2 * HALF, HQ, HALF, c1, c2, s1, s2, q_in, 0.0, 0.0, False, False, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_in, k_out, 2 * HALF, HK, HALF, c1, c2, s1, s2, k_in, 0.0, 0.0, False, False, BLOCK_HK, BLOCK_HALF)
    if COPY_V:  # v (or dv) copied as it is, beside q and k
        h = tl.arange(0, BLOCK_HK)[:, None]
        e = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = (h < HK) & (e < 2 * HALF)
        v = tl.load(v_ptr + token * v_token_stride + h * (2 * HALF) + e, mask=mask)
        tl.store(v_out_ptr + token * v_out_token_stride + h * (2 * HALF) + e, v, mask=mask)


def launch_config(Hq: int, Hk: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_HALF, num_warps): every head of a token in one program."""
    block_hq, block_hk = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk)
    block_half = triton.next_power_of_2(D // 2)
    # 512 elements of q per warp: 2 warps at TinyLlama's and Gemma 2's shapes (the warp sweep is in
    # docs/perf-notes.md)
    num_warps = max(1, min(8, block_hq * block_half // 512))
    return block_hq, block_hk, block_half, num_warps


def _tokens(x, copy=True):
    """x [B, T, H, D] and the distance between its tokens, in elements. A view whose tokens are evenly
    spaced, each with its heads contiguous (a column slice of the packed q/k/v projection output), is
    read in place; any other layout is copied first (copy=False: an output, which must have that layout)."""
    B, T, H, D = x.shape
    if x.stride(3) == 1 and x.stride(2) == D and x.stride(0) == T * x.stride(1):
        return x, x.stride(1)
    assert copy, f"rope: an output must have its tokens evenly spaced, heads contiguous; got strides {x.stride()}"
    return x.contiguous(), H * D


def rope_rotate(q, k, cos, sin, backward=False, v=None, out=None):
    """The launcher: (q_out, k_out), and v_out where v [B, T, Hk, D] is given (a copy of it), in their inputs'
    dtypes, new and contiguous, or written into `out`, views whose tokens are evenly spaced with their heads
    contiguous (column slices of one d(q | k | v)). backward=True applies the transpose map (dq, dk from dq_out,
    dk_out)."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    inputs = [_tokens(t) for t in (q, k) + (() if v is None else (v,))]
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = tuple(t.new_empty(t.shape) for t, _ in inputs) if out is None else out
    outputs = [_tokens(t, copy=False) for t in out]
    (q, q_stride), (k, k_stride) = inputs[:2]
    (v, v_stride), (v_out, v_out_stride) = (inputs[2], outputs[2]) if v is not None else ((q, 0), (q, 0))
    if B * T > 0:
        block_hq, block_hk, block_half, num_warps = launch_config(Hq, Hk, D)
        _rope_kernel[(B * T,)](
            q, k, q_stride, k_stride, out[0], out[1], outputs[0][1], outputs[1][1], cos, sin, cos.stride(0),
            cos.stride(1), v, v_stride, v_out, v_out_stride, T, Hq, Hk, D // 2,
            BACKWARD=backward, COPY_V=len(inputs) == 3, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
            num_warps=num_warps)
    return out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
            assert t.dtype in DTYPES, f"apply_rope: {name} must be fp32/bf16/fp16, got {t.dtype}"
        q_out, k_out = rope_rotate(q, k, cos, sin)
        assert q_out.dtype == q.dtype and k_out.dtype == k.dtype, "apply_rope: outputs must keep q's and k's dtypes"
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_rotate(dq_out, dk_out, cos, sin, backward=True)
        return dq, dk, None, None


def apply_rope(q, k, cos, sin):
    """Rotate q [B, T, Hq, D] and k [B, T, Hk, D] by cos, sin [B, T, D] (HF layout)."""
    check_rope_args(q, k, cos, sin)
    return _RoPE.apply(q, k, cos, sin)


class _RoPEQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, Hq, Hk, cos, sin):
        assert qkv.dtype in DTYPES and cos.dtype in DTYPES and sin.dtype in DTYPES, (
            f"apply_rope_qkv: qkv, cos and sin must be fp32/bf16/fp16, got {qkv.dtype}, {cos.dtype}, {sin.dtype}")
        q, k, v = qkv_heads(qkv, Hq, Hk)
        ctx.save_for_backward(cos, sin)
        ctx.Hk, ctx.dtype = Hk, qkv.dtype
        return rope_rotate(q, k, cos, sin, v=v)  # attention saves v: a copy, so that q | k | v can go

    @staticmethod
    def backward(ctx, dq_out, dk_out, dv):
        assert dq_out.dtype == dk_out.dtype == dv.dtype == ctx.dtype, (
            f"apply_rope_qkv: dq, dk, dv must have q | k | v's dtype {ctx.dtype}, got {dq_out.dtype}, "
            f"{dk_out.dtype}, {dv.dtype}")
        cos, sin = ctx.saved_tensors
        B, T, Hq, D = dq_out.shape
        dqkv = dq_out.new_empty(B, T, (Hq + 2 * ctx.Hk) * D)
        rope_rotate(dq_out, dk_out, cos, sin, backward=True, v=dv, out=qkv_heads(dqkv, Hq, ctx.Hk))
        return dqkv, None, None, None, None


def apply_rope_qkv(qkv, Hq, Hk, cos, sin):
    """(q, k, v) from one projection output qkv [B, T, (Hq + 2 Hk) D]: q [B, T, Hq, D] and k [B, T, Hk, D]
    rotated by cos, sin [B, T, D], v [B, T, Hk, D] a contiguous copy of its slice; the gradient of qkv comes
    back as one tensor of its layout (module docstring)."""
    check_rope_qkv_args(qkv, Hq, Hk, cos, sin)
    return _RoPEQKV.apply(qkv, Hq, Hk, cos, sin)
