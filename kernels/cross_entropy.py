"""Cross-entropy over a large vocabulary, one Triton program per row, with optional
logit scaling and soft-capping.

References: Liger-Kernel `ops/cross_entropy.py` (gradient written in the forward pass),
Unsloth `kernels/cross_entropy_loss.py` (chunked logsumexp), Milakov & Gimelshein 2018
"Online normalizer calculation for softmax".

Forward, for row i with logits x (length V) and target t:

    z      = softcap * tanh(scale * x / softcap)      scale first, then the cap; each optional
    lse    = log sum_j exp(z_j)
    loss_i = lse - z_t                                (0 where t == ignore_index)

A row longer than one block is read in chunks of BLOCK, keeping a running max m and a
running sum d of exp(z - m) (online logsumexp):

    m_k = max(m_{k-1}, max(z in chunk k))
    d_k = d_{k-1} * exp(m_{k-1} - m_k) + sum_{chunk k} exp(z - m_k)
    lse = m_K + log d_K

Gradient:

    dloss_i/dz_j = softmax(z)_j - [j == t]
    dz/dx        = scale * (1 - tanh^2) = scale * (1 - (z / softcap)^2)

The kernel writes this per-row gradient in the forward pass (a second read of the row),
so the backward pass only scales it by grad_output / num_targets ("mean") or grad_output
("sum"/"none"). The scale is applied in fp32 and rounded once: no underflow of small
probabilities before the loss scale is applied. Ignored rows get loss 0 and gradient 0.

"mean" divides by num_targets: a caller-given count (the tokens of a whole optimizer
step) or, by default, the non-ignored targets of this call, counted on the device.
Either is clamped to at least 1, so a call without targets gives loss 0, not NaN.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.tanh import tanh

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")
MAX_BLOCK = 32768  # logits per chunk: 32 fp32 values per thread at 32 warps


@triton.jit
def _effective_logits(x, scale, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    if HAS_SCALE:
        x = x * scale
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    return x


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_row_stride,
    dlogits_ptr, dlogits_row_stride,  # may be logits_ptr itself: every element is read before it is written
    targets_ptr, losses_ptr,
    V, ignore_index, scale, softcap,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    logits_ptr += row * logits_row_stride
    dlogits_ptr += row * dlogits_row_stride

    if target == ignore_index:
        tl.store(losses_ptr + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(dlogits_ptr + cols, tl.zeros([BLOCK], dlogits_ptr.dtype.element_ty), mask=cols < V)
        return

    # pass 1: online logsumexp over chunks
    m = -float("inf")
    d = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = _effective_logits(x, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))  # after the cap: softcap(-inf) is -softcap, not -inf
        m_new = tl.maximum(m, tl.max(z, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(d)

    x_target = tl.load(logits_ptr + target).to(tl.float32)
    z_target = _effective_logits(x_target, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
    tl.store(losses_ptr + row, lse - z_target)

    # pass 2: dloss/dx = (softmax(z) - onehot(t)) * dz/dx
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            z = _effective_logits(x, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            p = tl.exp(z - lse)
            dx = tl.where(cols == target, p - 1.0, p)
            if HAS_SOFTCAP:
                dx = dx * (1.0 - (z / softcap) * (z / softcap))
            if HAS_SCALE:
                dx = dx * scale
            tl.store(dlogits_ptr + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=mask)


def launch_config(V: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of V logits: the whole row in one chunk up to MAX_BLOCK."""
    block = min(triton.next_power_of_2(V), MAX_BLOCK)
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def cross_entropy_forward(logits, targets, *, ignore_index, softcap, scale, dlogits=None):
    """Per-row losses [N] in fp32. If dlogits is given ([N, V], logits' dtype, last dim
    contiguous), the unreduced gradient dloss_i/dlogits_i is written into it; it may be
    `logits` itself (the fused linear cross-entropy overwrites its logits chunk)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    N, V = logits.shape
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return losses
    if dlogits is not None:
        assert dlogits.shape == logits.shape and dlogits.stride(-1) == 1, "dlogits must be [N, V], last dim contiguous"
    block, num_warps = launch_config(V)
    _cross_entropy_kernel[(N,)](
        logits, logits.stride(0),
        logits if dlogits is None else dlogits, 0 if dlogits is None else dlogits.stride(0),
        targets, losses,
        V, ignore_index, 1.0 if scale is None else scale, 1.0 if softcap is None else softcap,
        HAS_SCALE=scale is not None, HAS_SOFTCAP=softcap is not None, COMPUTE_GRAD=dlogits is not None,
        BLOCK=block, num_warps=num_warps,
    )
    return losses


@dataclass(frozen=True)
class LossOptions:
    """The numerics shared by cross_entropy and fused_linear_cross_entropy."""
    ignore_index: int
    softcap: float | None
    scale: float | None
    reduction: str


def check_loss_args(logits_or_hidden, targets, opts: LossOptions, name: str):
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"reduction={opts.reduction!r}; expected one of {REDUCTIONS}")
    if opts.softcap is not None and not opts.softcap > 0:
        raise ValueError(f"softcap={opts.softcap}; expected a positive number, or None for no cap")
    if logits_or_hidden.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits_or_hidden.shape[0]:
        raise ValueError(f"{name} must be [N, *] and targets [N]; got {tuple(logits_or_hidden.shape)} and "
                         f"{tuple(targets.shape)}. Flatten batch and time first: x.reshape(-1, x.shape[-1]).")
    assert logits_or_hidden.dtype in LOGITS_DTYPES, f"{name} must be fp32/bf16/fp16, got {logits_or_hidden.dtype}"
    assert targets.dtype == torch.int64, f"targets must be int64, got {targets.dtype}"


def mean_denominator(targets, num_targets, ignore_index):
    """max(num_targets, 1), a python float or an fp32 0-dim device tensor: never a host sync."""
    if num_targets is None:
        num_targets = (targets != ignore_index).sum()
    if isinstance(num_targets, torch.Tensor):
        return num_targets.to(device=targets.device, dtype=torch.float32).clamp(min=1.0)
    return float(max(num_targets, 1))


def reduce_losses(losses, denominator, reduction):
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / denominator if reduction == "mean" else total


def grad_scale(grad_loss, denominator, reduction):
    """The fp32 factor that turns unreduced per-row gradients into d(total loss)."""
    if reduction == "none":
        return grad_loss.float()[:, None]  # (N, 1)
    g = grad_loss.float()
    return g / denominator if reduction == "mean" else g


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, num_targets, opts: LossOptions):
        compute_grad = ctx.needs_input_grad[0]
        dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
        losses = cross_entropy_forward(logits, targets, ignore_index=opts.ignore_index, softcap=opts.softcap,
                                       scale=opts.scale, dlogits=dlogits)
        denominator = mean_denominator(targets, num_targets, opts.ignore_index) if opts.reduction == "mean" else 1.0
        loss = reduce_losses(losses, denominator, opts.reduction)
        assert loss.dtype == torch.float32, f"loss must be float32, got {loss.dtype}"
        ctx.save_for_backward(dlogits)
        ctx.denominator, ctx.reduction = denominator, opts.reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (dlogits,) = ctx.saved_tensors
        # In place: the gradient buffer is ours, and a second backward is stopped by autograd's
        # version check on saved tensors. mul_ computes in fp32 and rounds once.
        dlogits.mul_(grad_scale(grad_loss, ctx.denominator, ctx.reduction))
        return dlogits, None, None, None


def cross_entropy(logits, targets, *, ignore_index=-100, softcap=None, scale=None, reduction="mean",
                  num_targets=None):
    """Cross-entropy of logits [N, V] (fp32/bf16/fp16, any strides) against int64 targets [N].

    Returns fp32: per-row losses [N] ("none"), their sum ("sum") or sum / num_targets ("mean").
    The gradient w.r.t. logits has the logits' dtype. See the module docstring for the math."""
    opts = LossOptions(ignore_index, softcap, scale, reduction)
    check_loss_args(logits, targets, opts, "logits")
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, targets, num_targets, opts)
    # no graph will be built (needs_input_grad does not see no_grad()): skip the gradient pass
    losses = cross_entropy_forward(logits, targets, ignore_index=ignore_index, softcap=softcap, scale=scale)
    denominator = mean_denominator(targets, num_targets, ignore_index) if reduction == "mean" else 1.0
    return reduce_losses(losses, denominator, reduction)


def cross_entropy_reference(logits, targets, *, ignore_index=-100, softcap=None, scale=None, reduction="mean",
                            num_targets=None):
    """Pure torch, fp32 math: the definition the kernel is tested against."""
    opts = LossOptions(ignore_index, softcap, scale, reduction)
    check_loss_args(logits, targets, opts, "logits")
    z = logits.float()
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    losses = F.cross_entropy(z, targets, ignore_index=ignore_index, reduction="none")  # (N,)
    denominator = mean_denominator(targets, num_targets, ignore_index) if reduction == "mean" else 1.0
    return reduce_losses(losses, denominator, reduction)
