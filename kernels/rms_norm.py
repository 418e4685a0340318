"""RMSNorm over the last dimension, one Triton program per row.

References: Zhang & Sennrich 2019 "Root Mean Square Layer Normalization"; Hugging Face
LlamaRMSNorm and GemmaRMSNorm (the two casting conventions); Liger-Kernel
`ops/rms_norm.py` (offset and casting mode as named arguments, dW from per-program
partial sums).

Forward, per row x of length H, with r = rsqrt(mean(x_fp32^2) + eps):

    cast="llama":  y = (offset + w) * round_x(x_fp32 * r)        HF LlamaRMSNorm: the
                   normalized value is rounded to x's dtype, then multiplied by the
                   weight in the promoted dtype (offset + w is rounded to w's dtype)
    cast="gemma":  y = round_x(x_fp32 * r * (offset + w_fp32))    HF GemmaRMSNorm, offset=1

Backward, with xhat = x * r (fp32; rounded to x's dtype for dW under "llama", as HF's
autograd sees it) and g = dy * (offset + w):

    dx = r * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat

dw is accumulated in fp32: each program sums its rows into one partial row, and the
partials are summed in torch and cast to w's dtype. A frozen w (LoRA) skips dw.

A layer's input x feeds both its norm and the residual stream, so x has two gradients: the norm's dx
and the residual's dres. `rms_norm_and_residual` returns (y, x) from one autograd Function, whose backward
adds dres to dx in the kernel (in fp32, one rounding), where autograd would add the two in a pass of its own.

Reference: kernels.references.rms_norm_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, check_rms_norm_args


@triton.jit
def _normalized(x, w, rstd, offset, x_ptr, w_ptr, GEMMA_CAST: tl.constexpr):
    """x · rstd · (offset + w) in fp32 with the reference's roundings: Gemma's in fp32 throughout; HF LlamaRMSNorm's
    x · rstd rounded to x's dtype and offset + w to w's (identity when x and w are fp32)."""
    if GEMMA_CAST:
        y = x * rstd * (offset + w)
    else:
        xhat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = xhat * (offset + w).to(w_ptr.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, x_row_stride, w_ptr, y_ptr, rstd_ptr,
    H, eps, offset,
    GEMMA_CAST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    y = _normalized(x, w, rstd, offset, x_ptr, w_ptr, GEMMA_CAST)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_ptr, rstd_ptr,
    dres_ptr, dres_row_stride,  # the residual stream's gradient of x, added to dx (HAS_DRES)
    dx_ptr, dw_partial_ptr,  # dx: [N, H] contiguous; dw_partial: [programs, H] fp32
    N, H, offset, rows_per_program,
    GEMMA_CAST: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA_CAST:
        w_eff = offset + w
    else:
        w_eff = (offset + w).to(w_ptr.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    # walk the rows by advancing the pointers (64-bit) rather than by row * stride
    dy_ptr += row_start.to(tl.int64) * dy_row_stride
    x_ptr += row_start.to(tl.int64) * x_row_stride
    dx_ptr += row_start.to(tl.int64) * H
    dres_ptr += row_start.to(tl.int64) * dres_row_stride
    for row in range(row_start, row_end):
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w_eff
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / H))
        if HAS_DRES:
            dx += tl.load(dres_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if GEMMA_CAST:
                dw += dy * xhat
            else:
                dw += dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        dy_ptr += dy_row_stride
        x_ptr += x_row_stride
        dres_ptr += dres_row_stride
        dx_ptr += H
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * H + cols, dw, mask=mask)


def launch_config(H: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one block. Few warps for short rows: each thread then moves
    more bytes per program (the sweep is in docs/perf-notes.md)."""
    block = triton.next_power_of_2(H)
    num_warps = 16 if block >= 8192 else 4 if block >= 2048 else 2
    return block, num_warps


def _rows(t, H):
    """A [N, H] view (a copy only if the last dim is strided)."""
    t = t.reshape(-1, H)
    return t if t.stride(-1) == 1 else t.contiguous()


def _backward_programs(device, N, compute_dw):
    """How many programs the backward runs. A frozen weight (LoRA): one per row, as many rows in flight as
    the GPU holds. With dW, each program walks its rows one after another into one partial dW row; one
    program per SM would leave the loads of one row waiting on the last, so 8 per SM keep more rows in
    flight. The interpreter runs programs one by one, so any count works on CPU: 4 exercises the partial sum."""
    if not compute_dw:
        return max(1, N)
    programs = 8 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(N, programs))


def rms_norm_forward(x, weight, eps, offset, cast):
    """(y with x's leading shape, rstd [N] fp32)."""
    H = x.shape[-1]
    x2 = _rows(x, H)
    N = x2.shape[0]
    y_dtype = x.dtype if cast == "gemma" else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((N, H), dtype=y_dtype, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    if N > 0:
        block, num_warps = launch_config(H)
        _rms_norm_forward_kernel[(N,)](x2, x2.stride(0), weight, y, rstd, H, eps, offset,
                                       GEMMA_CAST=cast == "gemma", BLOCK=block, num_warps=num_warps)
    return y.view(*x.shape[:-1], H), rstd


def rms_norm_backward(dy, x, weight, rstd, offset, cast, compute_dw=True, dres=None):
    """(dx in x's dtype and shape, dw in w's dtype, or None without compute_dw). dres: x's gradient from elsewhere
    (the residual stream, in x's dtype), added to dx."""
    H = x.shape[-1]
    x2, dy2 = _rows(x, H), _rows(dy, H)
    dres2 = x2 if dres is None else _rows(dres, H)  # x2 stands in for the pointer the kernel never reads
    N = x2.shape[0]
    dx = torch.empty((N, H), dtype=x.dtype, device=x.device)
    programs = _backward_programs(x.device, N, compute_dw)
    # every program writes its partial row (zeros when it has no rows), so empty is enough
    dw_partial = torch.empty((programs, H), dtype=torch.float32, device=x.device) if compute_dw else None
    if N > 0:
        block, num_warps = launch_config(H)
        _rms_norm_backward_kernel[(programs,)](
            dy2, dy2.stride(0), x2, x2.stride(0), weight, rstd, dres2, dres2.stride(0), dx,
            dx if dw_partial is None else dw_partial, N, H, offset, triton.cdiv(N, programs),
            GEMMA_CAST=cast == "gemma", COMPUTE_DW=compute_dw, HAS_DRES=dres is not None, BLOCK=block,
            num_warps=num_warps)
    elif compute_dw:
        dw_partial.zero_()
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype) if compute_dw else None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast):
        assert x.dtype in DTYPES, f"rms_norm: x must be fp32/bf16/fp16, got {x.dtype}"
        assert weight.dtype in DTYPES, f"rms_norm: weight must be fp32/bf16/fp16, got {weight.dtype}"
        y, rstd = rms_norm_forward(x, weight, eps, offset, cast)
        expected = x.dtype if cast == "gemma" else torch.promote_types(x.dtype, weight.dtype)
        assert y.dtype == expected, f"rms_norm: y must be {expected}, got {y.dtype}"
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.cast = offset, cast
        return y

    @staticmethod
    def backward(ctx, dy):
        return _RMSNorm.gradients(ctx, dy)

    @staticmethod
    def gradients(ctx, dy, dres=None):
        """(dx, dw, None, None, None) from what forward saved in ctx; dres, x's gradient from elsewhere, added to dx."""
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, ctx.offset, ctx.cast, ctx.needs_input_grad[1], dres)
        assert dx.dtype == x.dtype, f"rms_norm: dx must be {x.dtype}, got {dx.dtype}"
        assert dw is None or dw.dtype == weight.dtype, f"rms_norm: dweight must be {weight.dtype}, got {dw.dtype}"
        return dx, dw, None, None, None


def rms_norm(x, weight, eps=1e-6, offset=0.0, cast="llama"):
    """RMSNorm of x [..., H] with weight [H]; see the module docstring for offset and cast."""
    check_rms_norm_args(x, weight, cast)
    return _RMSNorm.apply(x, weight, eps, offset, cast)


class _RMSNormAndResidual(torch.autograd.Function):
    """(y, x): x's norm, and x itself (autograd returns an input as an alias whose gradient comes here), so that
    backward receives both of x's gradients, the norm's dy and the residual stream's dres, and sums them in the
    norm's backward kernel. Either may be None (not used)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast):
        y = _RMSNorm.forward(ctx, x, weight, eps, offset, cast)
        ctx.set_materialize_grads(False)
        return y, x

    @staticmethod
    def backward(ctx, dy, dres):
        dtype = ctx.saved_tensors[0].dtype
        assert dres is None or dres.dtype == dtype, f"rms_norm: the residual's gradient must be {dtype}"
        if dy is None:
            return dres, None, None, None, None
        return _RMSNorm.gradients(ctx, dy, dres)


def rms_norm_and_residual(x, weight, eps=1e-6, offset=0.0, cast="llama"):
    """(rms_norm(x, ...), x), where x's two gradients (the norm's and the residual stream's) are summed inside the
    norm's backward kernel: for a layer whose input goes both into its norm and into the residual add."""
    check_rms_norm_args(x, weight, cast)
    return _RMSNormAndResidual.apply(x, weight, eps, offset, cast)
