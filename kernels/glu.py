"""The launchers SwiGLU and GeGLU share: one elementwise Triton program per BLOCK elements of
gate and up, the forward writing h, the backward writing dgate and dup.

A GLU kernel takes (gate_ptr, up_ptr, scale_ptr, bias_ptr, h_ptr, amax_ptr, n, n_cols, ...) forward and
(dh_ptr, gate_ptr, up_ptr, scale_ptr, bias_ptr, dgate_ptr, dup_ptr, amax_ptr, n, n_cols, ...) backward, plus
its own constexprs, AFFINE, HAS_BIAS, AMAX and BLOCK; `load_gate_up` reads gate and up for both. With
inplace=True the backward writes dgate over gate and dup over up, each element being read before it
is overwritten: for fused callers (the LoRA MLP) that own gate and up and are done with them.

Per-row affine (DoRA's scaling of the MLP's gate and up, model/lora.py): with `scale` (2 · rows,)
and optionally `bias` (2 · rows,) for gate and up of shape (rows, n_cols), the activation reads

    G = gate ⊙ scale[:rows] + bias[:rows],   U = up ⊙ scale[rows:] + bias[rows:]     (per row)

in fp32 registers, in place of gate and up, and the backward returns dG and dU (the gradients with
respect to G and U, not to gate and up): new tensors, since the caller still reads gate and up.

write_h (backward): the kernel also stores h = act(G) * U over dh, each element after it is read, with the
forward's expression (the same bits): the LoRA MLP reads h after dh is spent (the down adapter's dA), and
would otherwise run the forward again over gate and up. The kernels take it as the constexpr WRITE_H.

amax: the largest |value| the call stores (h forward, dgate and dup backward), as the values are stored, into
a given 0-d tensor of their dtype: each program stores its block's (`block_amax`, constexpr AMAX), one
reduction over those follows. With --fp8 (model/fp8.py) the MLP's H and [dG | dU] take one e4m3 scale each from
their amax: this saves the pass over them that would find it.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def load_gate_up(gate_ptr, up_ptr, scale_ptr, bias_ptr, offs, mask, n, n_cols,
                 AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(G, U) in fp32 at `offs`: gate and up as stored, or their per-row affine (see the module docstring)."""
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if AFFINE:
        row = offs // n_cols
        rows = n // n_cols
        g = g * tl.load(scale_ptr + row, mask=mask, other=0.0).to(tl.float32)
        u = u * tl.load(scale_ptr + rows + row, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g = g + tl.load(bias_ptr + row, mask=mask, other=0.0).to(tl.float32)
            u = u + tl.load(bias_ptr + rows + row, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def block_amax(stored, mask):
    """max |stored| over the masked block, in stored's dtype (exact): a program's share of a call's amax."""
    return tl.max(tl.where(mask, tl.abs(stored.to(tl.float32)), 0.0), axis=0).to(stored.dtype)


def amax_args(like, programs, amax):
    """The kernels' (amax_ptr, AMAX): a (programs,) buffer for each program's block amax where `amax` (a 0-d
    tensor of like's dtype) is to be filled, else `like` as a stand-in pointer the kernel never reads."""
    if amax is None:
        return dict(amax_ptr=like, AMAX=False)
    assert amax.shape == () and amax.dtype == like.dtype and amax.device == like.device, \
        f"glu: amax must be a 0-d {like.dtype} tensor on {like.device}, got {tuple(amax.shape)} {amax.dtype}"
    return dict(amax_ptr=like.new_empty(programs), AMAX=True)


def reduce_amax(args, amax):
    """Fill `amax` with the largest of the programs' block amaxes (`amax_args`)."""
    if amax is not None:
        torch.amax(args["amax_ptr"], dim=0, out=amax)


def affine_args(gate, scale, bias):
    """The kernels' (scale, bias, n_cols, AFFINE, HAS_BIAS) for a per-row affine of (rows, n_cols) gate and up;
    without `scale`, gate stands in for the pointers the kernel never reads."""
    if scale is None:
        return dict(scale_ptr=gate, bias_ptr=gate, n_cols=1, AFFINE=False, HAS_BIAS=False)
    rows = len(gate)
    assert gate.dim() == 2 and scale.shape == (2 * rows,) and scale.is_contiguous(), \
        f"glu: a per-row scale is ({2 * rows},) for gate and up of {rows} rows, got {tuple(scale.shape)}"
    assert bias is None or (bias.shape == scale.shape and bias.is_contiguous()), "glu: bias must match scale"
    return dict(scale_ptr=scale, bias_ptr=scale if bias is None else bias, n_cols=gate.shape[1], AFFINE=True,
                HAS_BIAS=bias is not None)


def glu_forward(kernel, gate, up, scale=None, bias=None, amax=None, **constexprs):
    """h = act(G) * U by `kernel`, a new contiguous tensor of gate's shape and dtype; G, U = gate, up, or their
    per-row affine by scale and bias (see the module docstring). amax: a 0-d tensor to fill with max |h|."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = h.numel()
    if n > 0:
        programs = triton.cdiv(n, BLOCK)
        extra = amax_args(h, programs, amax)
        kernel[(programs,)](gate, up, h_ptr=h, n=n, **affine_args(gate, scale, bias), **extra, **constexprs,
                            BLOCK=BLOCK, num_warps=NUM_WARPS)
        reduce_amax(extra, amax)
    elif amax is not None:
        amax.zero_()
    return h


def glu_backward(kernel, dh, gate, up, inplace, name, scale=None, bias=None, write_h=False, amax=None,
                 **constexprs):
    """(dG, dU) by `kernel`: gate and up themselves when inplace (and no scale), else new tensors, rows of one
    (2, ...) buffer, so that dG and dU lie one after the other. write_h: (dG, dU, h), h written over dh (over
    its contiguous copy when dh is strided). amax: a 0-d tensor to fill with the largest |dG| or |dU|."""
    dh = dh.contiguous()
    if inplace and scale is None:
        if not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(f"{name}(inplace=True) needs contiguous gate and up to overwrite")
        dgate, dup = gate, up
    else:
        gate, up = gate.contiguous(), up.contiguous()
        dgate, dup = gate.new_empty((2, *gate.shape)).unbind(0)
    n = dh.numel()
    if n > 0:
        programs = triton.cdiv(n, BLOCK)
        extra = amax_args(dgate, programs, amax)
        kernel[(programs,)](dh, gate, up, dgate_ptr=dgate, dup_ptr=dup, n=n, **affine_args(gate, scale, bias),
                            **extra, **constexprs, WRITE_H=write_h, BLOCK=BLOCK, num_warps=NUM_WARPS)
        reduce_amax(extra, amax)
    elif amax is not None:
        amax.zero_()
    return (dgate, dup, dh) if write_h else (dgate, dup)
