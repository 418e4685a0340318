"""Cross-entropy over a large vocabulary, one Triton program per row, with optional
logit scaling and soft-capping.

References: Liger-Kernel `ops/cross_entropy.py` (gradient written in the forward pass),
Unsloth `kernels/cross_entropy_loss.py` (chunked logsumexp), Milakov & Gimelshein 2018
"Online normalizer calculation for softmax".

Forward, for row i with logits x (length V) and target t:

    z      = softcap * tanh(scale * x / softcap)      scale first, then the cap; each optional
    lse    = log sum_j exp(z_j)
    loss_i = lse - z_t                                (0 where t == ignore_index)

A row is read in chunks of BLOCK. Every lane l of the block keeps a running max m_l and
a running sum d_l of exp(z - m_l) over the elements it sees (online logsumexp), and the
lanes are combined once, after the last chunk:

    m_l <- max(m_l, z),   d_l <- d_l * exp(m_l(old) - m_l) + exp(z - m_l)
    M   = max_l m_l,      lse = M + log sum_l d_l * exp(m_l - M)

Per-lane state keeps cross-warp reductions out of the loop, so the loads of one chunk do
not wait on the reductions of the one before (the comparison with reducing per chunk is in
docs/perf-notes.md).

Gradient:

    dloss_i/dz_j = softmax(z)_j - [j == t]
    dz/dx        = scale * (1 - tanh(scale * x / softcap)^2)

The forward kernel reads each row once and keeps lse [N]. The backward kernel reads the
row again and writes g_i * dloss_i/dx, with g_i = grad_output / num_targets ("mean") or
grad_output ("sum"; per row for "none") read from a device tensor (no host sync). g is
applied in fp32 before the one rounding to the logits' dtype, so an fp16 loss scale does
not meet underflowed probabilities. Ignored rows get loss 0 and gradient 0. Memory and
traffic are those of autograd on the reference: the row is read twice, the gradient
written once.

The fused linear cross-entropy (kernels/fused_linear_cross_entropy.py) discards each
chunk's logits, so it asks the forward kernel for the unreduced gradient (g = 1) in the
same launch (COMPUTE_GRAD), written over the logits it has just read.

"mean" divides by num_targets: a caller-given count (the tokens of a whole optimizer
step) or, by default, the non-ignored targets of this call, counted on the device.
Either is clamped to at least 1, so a call without targets gives loss 0, not NaN.

Reference: kernels.references.cross_entropy_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import LossOptions, check_loss_args, reduce_losses
from kernels.tanh import tanh

# Logits per chunk (the block-size sweep is in docs/perf-notes.md): the forward keeps two fp32
# values per lane (m, d), so its chunks are smaller than the backward's, which keeps none.
FORWARD_MAX_BLOCK = 8192
BACKWARD_MAX_BLOCK = 32768


@triton.jit
def _effective_logits(x, scale, inv_softcap, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dx). The cap multiplies by 1/softcap and reuses tanh for the derivative: a
    soft-capped row is bound by special-function throughput (exp, reciprocal), not memory."""
    dzdx = 1.0
    if HAS_SCALE:
        x = x * scale
        dzdx = scale
    if HAS_SOFTCAP:
        t = tanh(x * inv_softcap)
        x = softcap * t
        dzdx = dzdx * (1.0 - t * t)
    return x, dzdx


@triton.jit
def _write_gradient(logits_ptr, dlogits_ptr, target, lse, g, V, scale, inv_softcap, softcap,
                    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """dlogits = g * (softmax(z) - onehot(target)) * dz/dx over one row, g in fp32."""
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z, dzdx = _effective_logits(x, scale, inv_softcap, softcap, HAS_SCALE, HAS_SOFTCAP)
        p = tl.exp(z - lse)
        dx = tl.where(cols == target, p - 1.0, p) * (g * dzdx)
        tl.store(dlogits_ptr + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_row(dlogits_ptr, V, BLOCK: tl.constexpr):
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(dlogits_ptr + cols, tl.zeros([BLOCK], dlogits_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr, logits_row_stride,
    dlogits_ptr, dlogits_row_stride,  # may be logits_ptr itself: every element is read before it is written
    targets_ptr, losses_ptr, lse_ptr,
    V, ignore_index, scale, inv_softcap, softcap,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    logits_ptr += row * logits_row_stride
    dlogits_ptr += row * dlogits_row_stride

    if target == ignore_index:
        tl.store(losses_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            _zero_row(dlogits_ptr, V, BLOCK)
        return

    # online logsumexp, per lane. m starts finite, so exp(m - m_new) is never exp(-inf + inf).
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _effective_logits(x, scale, inv_softcap, softcap, HAS_SCALE, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))  # after the cap: softcap(-inf) is -softcap, not -inf
        m_new = tl.maximum(m, z)
        d = d * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(d * tl.exp(m - m_row), 0))

    x_target = tl.load(logits_ptr + target).to(tl.float32)
    z_target, _ = _effective_logits(x_target, scale, inv_softcap, softcap, HAS_SCALE, HAS_SOFTCAP)
    tl.store(losses_ptr + row, lse - z_target)
    tl.store(lse_ptr + row, lse)
    if COMPUTE_GRAD:
        _write_gradient(logits_ptr, dlogits_ptr, target, lse, 1.0, V, scale, inv_softcap, softcap, HAS_SCALE,
                        HAS_SOFTCAP, BLOCK)


@triton.jit
def _cross_entropy_backward_kernel(
    logits_ptr, logits_row_stride, dlogits_ptr,  # dlogits: [N, V] contiguous
    targets_ptr, lse_ptr, g_ptr, g_stride,  # g: fp32, one value (stride 0) or one per row
    V, ignore_index, scale, inv_softcap, softcap,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    logits_ptr += row * logits_row_stride
    dlogits_ptr += row * V
    if target == ignore_index:
        _zero_row(dlogits_ptr, V, BLOCK)
    else:
        g = tl.load(g_ptr + row * g_stride)
        lse = tl.load(lse_ptr + row)
        _write_gradient(logits_ptr, dlogits_ptr, target, lse, g, V, scale, inv_softcap, softcap, HAS_SCALE,
                        HAS_SOFTCAP, BLOCK)


def launch_config(V: int, max_block: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of V logits: the whole row in one chunk up to max_block."""
    block = min(triton.next_power_of_2(V), max_block)
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def _numerics(scale, softcap):
    """The kernels' scale, inv_softcap, softcap arguments and flags."""
    return (1.0 if scale is None else scale, 1.0 if softcap is None else 1.0 / softcap,
            1.0 if softcap is None else softcap), dict(HAS_SCALE=scale is not None, HAS_SOFTCAP=softcap is not None)


def cross_entropy_forward(logits, targets, *, ignore_index, softcap, scale, dlogits=None):
    """(per-row losses [N] fp32, lse [N] fp32). If dlogits is given ([N, V], logits' dtype,
    last dim contiguous), the unreduced gradient dloss_i/dlogits_i is written into it in the
    same pass; it may be `logits` itself (the fused linear cross-entropy overwrites its
    logits chunk)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    N, V = logits.shape
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return losses, lse
    if dlogits is not None:
        assert dlogits.shape == logits.shape and dlogits.stride(-1) == 1, "dlogits must be [N, V], last dim contiguous"
    block, num_warps = launch_config(V, FORWARD_MAX_BLOCK)
    values, flags = _numerics(scale, softcap)
    _cross_entropy_forward_kernel[(N,)](
        logits, logits.stride(0),
        logits if dlogits is None else dlogits, 0 if dlogits is None else dlogits.stride(0),
        targets, losses, lse, V, ignore_index, *values,
        **flags, COMPUTE_GRAD=dlogits is not None, BLOCK=block, num_warps=num_warps,
    )
    return losses, lse


def cross_entropy_backward(logits, targets, lse, g, *, ignore_index, softcap, scale):
    """dlogits [N, V] in logits' dtype: g * dloss_i/dlogits_i, with g an fp32 tensor of one
    value or of one value per row."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    N, V = logits.shape
    dlogits = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if N == 0:
        return dlogits
    g = g.reshape(-1).contiguous()
    assert g.dtype == torch.float32 and g.numel() in (1, N), \
        f"g must be fp32 with 1 or N values, got {g.dtype}, {g.numel()}"
    block, num_warps = launch_config(V, BACKWARD_MAX_BLOCK)
    values, flags = _numerics(scale, softcap)
    _cross_entropy_backward_kernel[(N,)](
        logits, logits.stride(0), dlogits,
        targets.contiguous(), lse, g, 0 if g.numel() == 1 else 1, V, ignore_index, *values,
        **flags, BLOCK=block, num_warps=num_warps,
    )
    return dlogits


def grad_scale(grad_loss, denominator, reduction):
    """The fp32 factor that turns unreduced per-row gradients into d(total loss)."""
    if reduction == "none":
        return grad_loss.float()[:, None]  # (N, 1)
    g = grad_loss.float()
    return g / denominator if reduction == "mean" else g


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, num_targets, opts: LossOptions):
        losses, lse = cross_entropy_forward(logits, targets, ignore_index=opts.ignore_index, softcap=opts.softcap,
                                            scale=opts.scale)
        loss, denominator = reduce_losses(losses, targets, num_targets, opts)
        assert loss.dtype == torch.float32, f"loss must be float32, got {loss.dtype}"
        ctx.save_for_backward(logits, targets, lse)
        ctx.denominator, ctx.opts = denominator, opts
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        opts = ctx.opts
        g = grad_scale(grad_loss, ctx.denominator, opts.reduction)  # fp32: 0-dim, or (N, 1) for "none"
        dlogits = cross_entropy_backward(logits, targets, lse, g, ignore_index=opts.ignore_index,
                                         softcap=opts.softcap, scale=opts.scale)
        assert dlogits.dtype == logits.dtype, f"dlogits must be {logits.dtype}, got {dlogits.dtype}"
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
    # no graph will be built (needs_input_grad does not see no_grad()): save nothing for backward
    losses, _ = cross_entropy_forward(logits, targets, ignore_index=ignore_index, softcap=softcap, scale=scale)
    return reduce_losses(losses, targets, num_targets, opts)[0]
