"""SwiGLU activation h = silu(gate) * up, elementwise, any shape.

References: Shazeer 2020 "GLU Variants Improve Transformer"; Hugging Face LlamaMLP
(`act_fn(gate_proj(x)) * up_proj(x)`); Unsloth `kernels/swiglu.py` (in-place backward).

With s = sigmoid(g):

    h     = g * s * u
    dup   = dh * g * s
    dgate = dh * u * s * (1 + g * (1 - s))         since d(g s)/dg = s + g s (1 - s)

All math in fp32; one rounding at the store. HF rounds twice (silu(g), then the
product), so the kernel differs from `swiglu_reference` by at most about one ulp.

`swiglu_forward` and `swiglu_backward` are plain functions for fused callers (the LoRA
MLP) that manage their own buffers; `swiglu_backward(..., inplace=True)` writes dgate
over gate and dup over up, each element being read before it is overwritten.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dup = dh * g * s
    dgate = dh * u * s * (1.0 + g * (1.0 - s))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, dup.to(dup_ptr.dtype.element_ty), mask=mask)


def _check(*tensors):
    shape, dtype = tensors[0].shape, tensors[0].dtype
    assert dtype in DTYPES, f"swiglu: inputs must be fp32/bf16/fp16, got {dtype}"
    for t in tensors[1:]:
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"swiglu: gate, up (and dh) must share shape and dtype; got {tuple(shape)} {dtype} "
                             f"and {tuple(t.shape)} {t.dtype}")


def swiglu_forward(gate, up):
    """h = silu(gate) * up, a new contiguous tensor of gate's shape and dtype."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = h.numel()
    if n > 0:
        _swiglu_forward_kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return h



def glu_grad_buffers(dh, gate, up, inplace, who):
    """(dh, gate, up, dgate, dup) for a GLU backward launch: contiguous inputs, and outputs that
    are new tensors, or gate and up themselves when inplace (the caller is done with them)."""
    dh = dh.contiguous()
    if inplace:
        if not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(f"{who}(inplace=True) needs contiguous gate and up to overwrite")
        return dh, gate, up, gate, up
    gate, up = gate.contiguous(), up.contiguous()
    return dh, gate, up, torch.empty_like(gate), torch.empty_like(up)

def swiglu_backward(dh, gate, up, inplace=False):
    """(dgate, dup). inplace=True writes them into gate and up (which must be contiguous) and
    returns those tensors; use it only when the caller owns gate and up and is done with them."""
    _check(dh, gate, up)
    dh, gate, up, dgate, dup = glu_grad_buffers(dh, gate, up, inplace, "swiglu_backward")
    n = dh.numel()
    if n > 0:
        _swiglu_backward_kernel[(triton.cdiv(n, BLOCK),)](dh, gate, up, dgate, dup, n, BLOCK=BLOCK,
                                                           num_warps=NUM_WARPS)
    return dgate, dup


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
    _check(gate, up)
    return _SwiGLU.apply(gate, up)


def swiglu_reference(gate, up):
    """Pure torch, as HF LlamaMLP (in the inputs' dtype)."""
    return F.silu(gate) * up
