"""SwiGLU activation h = silu(gate) * up, elementwise, any shape.

References: Shazeer 2020 "GLU Variants Improve Transformer"; Hugging Face LlamaMLP
(`act_fn(gate_proj(x)) * up_proj(x)`); Unsloth `kernels/swiglu.py` (in-place backward).

With s = sigmoid(g):

    h     = g * s * u
    dup   = dh * g * s
    dgate = dh * u * s * (1 + g * (1 - s))         since d(g s)/dg = s + g s (1 - s)

The backward can also write h (as the forward computes it, to the bit) over dh: the LoRA MLP's down
adapter needs h for its dA after dh is spent, and this saves a forward pass over gate and up.

All math in fp32; one rounding at the store. HF rounds twice (silu(g), then the
product), so the kernel differs from the reference by at most about one ulp.

`swiglu_forward` and `swiglu_backward` are plain functions for fused callers (the LoRA
MLP) that manage their own buffers; the launchers and `inplace` are kernels/glu.py's.

Reference: kernels.references.swiglu_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.glu import (
    block_amax,
    glu_backward,
    glu_forward,
    load_dh,
    load_gate_up,
    strip_right,
    strip_rights,
    tile,
    tile_steps,
)
from kernels.references import check_glu_args


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, scale_ptr, bias_ptr, h_ptr, amax_ptr, n, n_cols, terms,
                           AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, AMAX: tl.constexpr, TERMS: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr,
                           DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    amax = tl.zeros((), dtype=tl.float32)
    rights = strip_rights(terms, n_cols, TERMS, BLOCK_C, BLOCK_K)
    for step in tl.range(0, tile_steps(n, n_cols, TERMS, BLOCK_R, BLOCK_C, STEPS), num_stages=STAGES):
        offs, mask, rows, cols = tile(step, n, n_cols, TERMS, BLOCK, BLOCK_R, BLOCK_C, STEPS)
        g, u = load_gate_up(gate_ptr, up_ptr, scale_ptr, bias_ptr, terms, rights, offs, mask, rows, cols, n, n_cols,
                            AFFINE, HAS_BIAS, TERMS, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS, DTYPE, OPERAND, PRECISION)
        h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        if AMAX:
            amax = tl.maximum(amax, block_amax(h, mask), propagate_nan=tl.PropagateNan.ALL)
    if AMAX:
        tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))


@triton.jit
def _swiglu_backward_kernel(dh_ptr, gate_ptr, up_ptr, scale_ptr, bias_ptr, dgate_ptr, dup_ptr, amax_ptr, n,
                            n_cols, terms, dh_term, AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, AMAX: tl.constexpr,
                            WRITE_H: tl.constexpr, TERMS: tl.constexpr, GATE_UP_TERMS: tl.constexpr,
                            DH_TERM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
                            STEPS: tl.constexpr, STAGES: tl.constexpr, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                            PRECISION: tl.constexpr):
    amax = tl.zeros((), dtype=tl.float32)
    rights = strip_rights(terms, n_cols, GATE_UP_TERMS, BLOCK_C, BLOCK_K)
    dh_right = strip_right(dh_term, n_cols, DH_TERM, BLOCK_C, BLOCK_K)
    for step in tl.range(0, tile_steps(n, n_cols, TERMS, BLOCK_R, BLOCK_C, STEPS), num_stages=STAGES):
        offs, mask, rows, cols = tile(step, n, n_cols, TERMS, BLOCK, BLOCK_R, BLOCK_C, STEPS)
        dh = load_dh(dh_ptr, dh_term, dh_right, offs, mask, rows, cols, n, n_cols, DH_TERM, BLOCK_R, BLOCK_C, BLOCK_K,
                     K_CHUNKS, DTYPE, OPERAND, PRECISION)
        g, u = load_gate_up(gate_ptr, up_ptr, scale_ptr, bias_ptr, terms, rights, offs, mask, rows, cols, n, n_cols,
                            AFFINE, HAS_BIAS, GATE_UP_TERMS, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS, DTYPE, OPERAND,
                            PRECISION)
        s = tl.sigmoid(g)
        dup = (dh * g * s).to(dup_ptr.dtype.element_ty)
        dgate = (dh * u * s * (1.0 + g * (1.0 - s))).to(dgate_ptr.dtype.element_ty)
        tl.store(dgate_ptr + offs, dgate, mask=mask)
        tl.store(dup_ptr + offs, dup, mask=mask)
        if AMAX:
            amax = tl.maximum(amax, tl.maximum(block_amax(dgate, mask), block_amax(dup, mask)),
                              propagate_nan=tl.PropagateNan.ALL)
        if WRITE_H:  # the forward's expression, so the same bits
            tl.store(dh_ptr + offs, (g * s * u).to(dh_ptr.dtype.element_ty), mask=mask)
    if AMAX:
        tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))


def swiglu_forward(gate, up, scale=None, bias=None, amax=None, terms=None):
    """h = silu(gate) * up, a new contiguous tensor of gate's shape and dtype. scale, bias: a per-row affine
    of gate and up first; terms: low-rank terms ((L_gate, R_gate), (L_up, R_up)) added to them (kernels/glu.py).
    amax: a 0-d tensor of h's dtype to fill with max |h|."""
    check_glu_args("swiglu", gate, up)
    return glu_forward(_swiglu_forward_kernel, gate, up, scale, bias, amax, terms)


def swiglu_backward(dh, gate, up, inplace=False, scale=None, bias=None, write_h=False, amax=None, terms=None,
                    dh_term=None):
    """(dgate, dup). inplace=True writes them into gate and up (which must be contiguous) and
    returns those tensors; use it only when the caller owns gate and up and is done with them.
    scale, bias: the gradients with respect to the per-row affine of gate and up (kernels/glu.py), in new
    tensors. write_h: also h = silu(G) * U, written over dh, and (dgate, dup, h) returned (kernels/glu.py).
    amax: a 0-d tensor of their dtype to fill with the largest |dgate| or |dup|. terms, dh_term: low-rank
    terms added to gate and up (as forward) and to dh (kernels/glu.py); dgate and dup are then dG and dU."""
    check_glu_args("swiglu", dh, gate, up)
    return glu_backward(_swiglu_backward_kernel, dh, gate, up, inplace, "swiglu_backward", scale, bias, write_h,
                        amax, terms, dh_term)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        h = swiglu_forward(gate, up)
        assert h.dtype == gate.dtype, f"swiglu: h must be {gate.dtype}, got {h.dtype}"
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        assert dh.dtype == gate.dtype, f"swiglu: dh must be {gate.dtype}, got {dh.dtype}"
        return swiglu_backward(dh, gate, up)


def swiglu(gate, up):
    """silu(gate) * up for gate, up of one shape and dtype."""
    check_glu_args("swiglu", gate, up)
    return _SwiGLU.apply(gate, up)
