"""GeGLU activation h = gelu(gate) * up, elementwise, any shape; gelu exact (erf) or
its tanh approximation.

References: Shazeer 2020 "GLU Variants Improve Transformer"; Hendrycks & Gimpel 2016
"GELUs"; Hugging Face GemmaMLP (`gelu_pytorch_tanh`); Unsloth `kernels/geglu.py`.

approximate="none":  gelu(g)  = 0.5 g (1 + erf(g / sqrt2))
                     gelu'(g) = 0.5 (1 + erf(g / sqrt2)) + g * exp(-g^2 / 2) / sqrt(2 pi)
approximate="tanh":  t = tanh(k (g + c g^3)), k = sqrt(2 / pi), c = 0.044715
                     gelu(g)  = 0.5 g (1 + t)
                     gelu'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 c g^2)
then
    h = gelu(g) * u,   dup = dh * gelu(g),   dgate = dh * u * gelu'(g)

and the backward can also write h (the forward's bits) over dh, as kernels/swiglu.py's does.

tanh(x) is computed from exp(-2|x|) (libdevice.tanh does not run in the
interpreter). All math in fp32; one rounding at the store, whereas HF rounds gelu(g)
and the product separately (about one ulp apart). `geglu_forward` / `geglu_backward`
are the plain functions for fused callers; the launchers and `inplace` are kernels/glu.py's.

Reference: kernels.references.geglu_reference.
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
from kernels.tanh import tanh


@triton.jit
def _gelu_and_grad(g, APPROX_TANH: tl.constexpr):
    """(gelu(g), gelu'(g)) in fp32."""
    if APPROX_TANH:
        k = 0.7978845608028654  # sqrt(2 / pi)
        c = 0.044715
        t = tanh(k * (g + c * g * g * g))
        gelu = 0.5 * g * (1.0 + t)
        dgelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * c * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))  # 1 / sqrt2
        gelu = g * cdf
        dgelu = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return gelu, dgelu


@triton.jit
def _geglu_forward_kernel(gate_ptr, up_ptr, scale_ptr, bias_ptr, h_ptr, amax_ptr, n, n_cols, terms,
                          APPROX_TANH: tl.constexpr, AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          AMAX: tl.constexpr, TERMS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, STEPS: tl.constexpr,
                          STAGES: tl.constexpr, DTYPE: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    amax = tl.zeros((), dtype=tl.float32)
    rights = strip_rights(terms, n_cols, TERMS, BLOCK_C, BLOCK_K)
    for step in tl.range(0, tile_steps(n, n_cols, TERMS, BLOCK_R, BLOCK_C, STEPS), num_stages=STAGES):
        offs, mask, rows, cols = tile(step, n, n_cols, TERMS, BLOCK, BLOCK_R, BLOCK_C, STEPS)
        g, u = load_gate_up(gate_ptr, up_ptr, scale_ptr, bias_ptr, terms, rights, offs, mask, rows, cols, n, n_cols,
                            AFFINE, HAS_BIAS, TERMS, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS, DTYPE, OPERAND, PRECISION)
        gelu, _ = _gelu_and_grad(g, APPROX_TANH)
        h = (gelu * u).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        if AMAX:
            amax = tl.maximum(amax, block_amax(h, mask), propagate_nan=tl.PropagateNan.ALL)
    if AMAX:
        tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))


@triton.jit
def _geglu_backward_kernel(dh_ptr, gate_ptr, up_ptr, scale_ptr, bias_ptr, dgate_ptr, dup_ptr, amax_ptr, n, n_cols,
                           terms, dh_term, APPROX_TANH: tl.constexpr, AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           AMAX: tl.constexpr, WRITE_H: tl.constexpr, TERMS: tl.constexpr,
                           GATE_UP_TERMS: tl.constexpr, DH_TERM: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                           K_CHUNKS: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, DTYPE: tl.constexpr,
                           OPERAND: tl.constexpr, PRECISION: tl.constexpr):
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
        gelu, dgelu = _gelu_and_grad(g, APPROX_TANH)
        dgate = (dh * u * dgelu).to(dgate_ptr.dtype.element_ty)
        dup = (dh * gelu).to(dup_ptr.dtype.element_ty)
        tl.store(dgate_ptr + offs, dgate, mask=mask)
        tl.store(dup_ptr + offs, dup, mask=mask)
        if AMAX:
            amax = tl.maximum(amax, tl.maximum(block_amax(dgate, mask), block_amax(dup, mask)),
                              propagate_nan=tl.PropagateNan.ALL)
        if WRITE_H:
            tl.store(dh_ptr + offs, (gelu * u).to(dh_ptr.dtype.element_ty), mask=mask)
    if AMAX:
        tl.store(amax_ptr + tl.program_id(0), amax.to(amax_ptr.dtype.element_ty))


def geglu_forward(gate, up, approximate="tanh", scale=None, bias=None, amax=None, terms=None):
    """h = gelu(gate) * up, a new contiguous tensor of gate's shape and dtype. scale, bias: a per-row affine
    of gate and up first; terms: low-rank terms ((L_gate, R_gate), (L_up, R_up)) added to them (kernels/glu.py).
    amax: a 0-d tensor of h's dtype to fill with max |h|."""
    check_glu_args("geglu", gate, up, approximate=approximate)
    return glu_forward(_geglu_forward_kernel, gate, up, scale, bias, amax, terms, APPROX_TANH=approximate == "tanh")


def geglu_backward(dh, gate, up, approximate="tanh", inplace=False, scale=None, bias=None, write_h=False,
                   amax=None, terms=None, dh_term=None):
    """(dgate, dup). inplace=True writes them into gate and up (which must be contiguous) and
    returns those tensors; use it only when the caller owns gate and up and is done with them.
    scale, bias: the gradients with respect to the per-row affine of gate and up (kernels/glu.py), in new
    tensors. write_h: also h = gelu(G) * U, written over dh, and (dgate, dup, h) returned (kernels/glu.py).
    amax: a 0-d tensor of their dtype to fill with the largest |dgate| or |dup|. terms, dh_term: low-rank
    terms added to gate and up (as forward) and to dh (kernels/glu.py); dgate and dup are then dG and dU."""
    check_glu_args("geglu", dh, gate, up, approximate=approximate)
    return glu_backward(_geglu_backward_kernel, dh, gate, up, inplace, "geglu_backward", scale, bias, write_h,
                        amax, terms, dh_term, APPROX_TANH=approximate == "tanh")


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, approximate):
        h = geglu_forward(gate, up, approximate)
        assert h.dtype == gate.dtype, f"geglu: h must be {gate.dtype}, got {h.dtype}"
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        return h

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        assert dh.dtype == gate.dtype, f"geglu: dh must be {gate.dtype}, got {dh.dtype}"
        dgate, dup = geglu_backward(dh, gate, up, ctx.approximate)
        return dgate, dup, None


def geglu(gate, up, approximate="tanh"):
    """gelu(gate) * up for gate, up of one shape and dtype; approximate in {"tanh", "none"}."""
    check_glu_args("geglu", gate, up, approximate=approximate)
    return _GeGLU.apply(gate, up, approximate)
