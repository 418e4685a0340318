"""A residual add and the RMSNorm after it in one Triton program per row, forward only: a decoding
step's `x = x + f(x)` followed by the next norm, one launch where two ran; with sandwich norms (Gemma
2/3: `x = x + norm_r(f(x))`), the norm of the sublayer's output too, one launch where three ran.

References: kernels/rms_norm.py (the norm, operation for operation); Liger-Kernel and vLLM's
fused_add_rms_norm (the same pairing).

Per row of length H:

    r = rms_norm_r(r)                   with r_weight only: kernels/rms_norm.py's forward on r, in r's dtype
    s = round_x(x_fp32 + r_fp32)        what torch's add of two tensors of x's dtype returns
    y = rms_norm(s)                     kernels/rms_norm.py's forward on s, cast="llama" or "gemma"

the operations of the separate (norm,) add and rms_norm kernels in their order, so s and y are theirs
(bit for bit in Triton's interpreter; on a GPU within how the compiler contracts products and sums into
FMAs); both norms take eps, offset and cast from the arguments (a model's norms share them). Both s
and y are returned: s is the next residual, y the next sublayer's input. On Hopper the kernel is a
programmatic dependent launch, as the decoding kernels are (kernels/decode_linear.py): it starts while
the GEMM before it runs and waits for it before its first load.

Reference: kernels.references.add_rms_norm_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.decode_linear import _after_previous, pdl_constexprs
from kernels.references import DTYPES, check_rms_norm_args
from kernels.rms_norm import _normalized, launch_config


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, rw_ptr, s_ptr, y_ptr,  # x, r: [N, H] with row strides; s, y: [N, H] contiguous
    x_row_stride, r_row_stride, H, eps, offset,
    NORM_R: tl.constexpr, GEMMA_CAST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_R:  # r's own norm first, rounded to r's dtype as the norm's output is
        rw = tl.load(rw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        r_rstd = tl.rsqrt(tl.sum(r * r, 0) / H + eps)
        r = _normalized(r, rw, r_rstd, offset, r_ptr, rw_ptr, GEMMA_CAST).to(r_ptr.dtype.element_ty).to(tl.float32)
    s = (x + r).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * H + cols, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / H + eps)
    y = _normalized(s, w, rstd, offset, s_ptr, w_ptr, GEMMA_CAST)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x, r, weight, eps=1e-6, offset=0.0, cast="llama", r_weight=None):
    """(s, y): s = x + r (x's dtype and shape, contiguous), y = RMSNorm of s with weight [H] (see
    kernels/rms_norm.py for offset and cast). x, r [..., H] of one shape and dtype. r_weight [H]: r is
    first normalized by an RMSNorm of that weight (the same eps, offset and cast), whose output must
    keep r's dtype. No gradients."""
    check_rms_norm_args(x, weight, cast)
    if r_weight is not None:
        check_rms_norm_args(r, r_weight, cast)
        if cast != "gemma" and torch.promote_types(r.dtype, r_weight.dtype) != r.dtype:
            raise ValueError(f"add_rms_norm: r's norm would return {torch.promote_types(r.dtype, r_weight.dtype)} "
                             f"for r of {r.dtype}; give r_weight in {r.dtype}")
    if r.shape != x.shape or r.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x and r must share shape and dtype; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(r.shape)} {r.dtype}")
    assert x.dtype in DTYPES and weight.dtype in DTYPES, f"add_rms_norm: fp32/bf16/fp16, got {x.dtype}, {weight.dtype}"
    assert r_weight is None or r_weight.dtype in DTYPES, f"add_rms_norm: fp32/bf16/fp16, got {r_weight.dtype}"
    H = x.shape[-1]
    x2, r2 = x.reshape(-1, H), r.reshape(-1, H)
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    N = x2.shape[0]
    s = torch.empty((N, H), dtype=x.dtype, device=x.device)
    y = torch.empty((N, H), dtype=x.dtype if cast == "gemma" else torch.promote_types(x.dtype, weight.dtype),
                    device=x.device)
    if N > 0:
        block, num_warps = launch_config(H)
        _add_rms_norm_kernel[(N,)](x2, r2, weight, weight if r_weight is None else r_weight, s, y, x2.stride(0),
                                   r2.stride(0), H, eps, offset, NORM_R=r_weight is not None,
                                   GEMMA_CAST=cast == "gemma", BLOCK=block, num_warps=num_warps, **pdl_constexprs(x2))
    return s.view(x.shape), y.view(*x.shape[:-1], H)
