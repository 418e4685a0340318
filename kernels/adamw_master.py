"""AdamW over fp32 master weights in one pass: the optimizer step of full fine-tuning in bf16 or fp16.

For each element i of a flat run of parameters, with g_i the weight's gradient (bf16/fp16/fp32) and f the
unscale and clip factor (a device scalar: clip_coef / loss_scale, so no host sync):

    g  = f · g_i
    p  = p − lr·λ·p                                   decoupled weight decay (Loshchilov & Hutter 2019)
    m  = β₁·m + (1 − β₁)·g
    v  = β₂·v + (1 − β₂)·g²
    p  = p − (lr / c₁) · m / (√v / √c₂ + ε),          c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ   (bias corrections)
    w  = round(p)                                     the model's weight, in its dtype (nearest even)

as torch.optim.AdamW(fused=True) writes it (aten's fused_adam_utils, ADAMW mode), in fp32. p, m, v are the fp32
master, exp_avg and exp_avg_sq. lr / c₁ and √c₂ come in `coefs`, a device tensor (masters.bias_corrections
computes them in fp64): the step count t lives on the device, where the loss scaler's skip decides whether it
advances. Where `found_inf` is nonzero the kernel writes nothing: a skipped step changes no weight and no moment.

Bytes per parameter: the gradient read (2), p, m, v read and written (24), the weight written (2): 28 for bf16,
one launch for a whole flat buffer, where the per-weight path reads and writes each tensor in several passes
(upcast of the gradient, unscale, clip, the fused AdamW, the copy back into the weight).

Reference: kernels.references.adamw_master_reference; torch.optim.AdamW(fused=True).
"""
import torch
import triton
import triton.language as tl

from kernels.nf4_dequantize import _to_bf16

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _adamw_master_kernel(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, weight_ptr, factor_ptr, found_inf_ptr,
                         coefs_ptr, n, lr_decay, beta1, beta2, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    ok = offs < tl.where(tl.load(found_inf_ptr) == 0, n, 0)  # a skipped step reads and writes nothing
    factor = tl.load(factor_ptr).to(tl.float32)
    step_size = tl.load(coefs_ptr)  # lr / c1
    c2_sqrt = tl.load(coefs_ptr + 1)
    g = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32) * factor
    p = tl.load(master_ptr + offs, mask=ok, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=ok, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=ok, other=0.0)
    p = p - lr_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v) / c2_sqrt + eps
    p = p - step_size * m / denom
    tl.store(master_ptr + offs, p, mask=ok)
    tl.store(exp_avg_ptr + offs, m, mask=ok)
    tl.store(exp_avg_sq_ptr + offs, v, mask=ok)
    if weight_ptr.dtype.element_ty == tl.bfloat16:  # nearest even on the GPU and in the interpreter alike
        tl.store(weight_ptr + offs, _to_bf16(p), mask=ok)
    else:
        tl.store(weight_ptr + offs, p.to(weight_ptr.dtype.element_ty), mask=ok)


def adamw_master_(master, exp_avg, exp_avg_sq, grad, weight, factor, found_inf, coefs, *, lr, weight_decay, betas,
                  eps):
    """One AdamW step over flat contiguous tensors, in place: master, exp_avg, exp_avg_sq (fp32, [n]) and weight
    ([n], the model's dtype, = the new master rounded), from grad ([n], any float dtype) × factor (0-dim fp32).
    found_inf: 0-dim fp32, nonzero to skip. coefs: [lr / c₁, √c₂] (fp32, masters.bias_corrections)."""
    n = master.numel()
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad), ("weight", weight)):
        if t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adamw_master: {name} must be contiguous with {n} elements, got {tuple(t.shape)}")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"adamw_master: {name} must be contiguous fp32, got {t.dtype}")
    if n == 0:
        return
    _adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
        master, exp_avg, exp_avg_sq, grad, weight, factor, found_inf, coefs, n, lr * weight_decay, betas[0],
        betas[1], eps, BLOCK=BLOCK, num_warps=NUM_WARPS)
