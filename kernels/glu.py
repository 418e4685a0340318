"""The launchers SwiGLU and GeGLU share: one elementwise Triton program per BLOCK elements of
gate and up, the forward writing h, the backward writing dgate and dup.

A GLU kernel takes (gate_ptr, up_ptr, h_ptr, n, ...) forward and (dh_ptr, gate_ptr, up_ptr,
dgate_ptr, dup_ptr, n, ...) backward, plus its own constexprs and BLOCK. With inplace=True the
backward writes dgate over gate and dup over up, each element being read before it is
overwritten: for fused callers (the LoRA MLP) that own gate and up and are done with them.
"""
import torch
import triton

BLOCK = 1024
NUM_WARPS = 4


def glu_forward(kernel, gate, up, **constexprs):
    """h = act(gate) * up by `kernel`, a new contiguous tensor of gate's shape and dtype."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = h.numel()
    if n > 0:
        kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, **constexprs, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return h


def glu_backward(kernel, dh, gate, up, inplace, name, **constexprs):
    """(dgate, dup) by `kernel`: new tensors, or gate and up themselves when inplace."""
    dh = dh.contiguous()
    if inplace:
        if not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(f"{name}(inplace=True) needs contiguous gate and up to overwrite")
        dgate, dup = gate, up
    else:
        gate, up = gate.contiguous(), up.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = dh.numel()
    if n > 0:
        kernel[(triton.cdiv(n, BLOCK),)](dh, gate, up, dgate, dup, n, **constexprs, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dgate, dup
