"""lm_head matmul fused with cross-entropy: the loss of hidden states [N, H] against a
vocabulary projection W [V, H] without ever holding the [N, V] logits.

References: Liger-Kernel `ops/fused_linear_cross_entropy.py` (gradients in the forward
pass, chunked over tokens), Wijmans et al. 2024 "Cut Your Losses in Large-Vocabulary
Language Models".

Forward, per chunk of C tokens (C from `chunk_rows`: logits of CHUNK_BYTES, within bounds):

    logits = h_c @ W^T (+ b)                           [C, V], compute dtype
    loss_c, G = cross_entropy kernel on logits         G = dloss_i/dlogits, unreduced,
                                                       written over the logits buffer
    dH[c]  = G @ W                                     [C, H], kept in fp32
    dW    += G^T @ h_c        (only if W requires grad) [V, H], kept in fp32
    db    += sum_rows G       (only if b requires grad)

Backward scales the fp32 buffers by s = grad_output / num_targets ("mean") or
grad_output ("sum") and casts once, so an fp16 loss scale of 65536 is applied before
any rounding to fp16. "none" scales row i of dH by grad_output[i]; it cannot do so inside
the sum that forms dW or db, so reduction="none" with a trainable W or b is refused.

G is unreduced (|G| <= 1, elementwise) so that fp16 does not underflow before the loss
scale arrives. Its products over tokens can then exceed fp16's range: dH = G @ W cannot
(|dH| <= 2 max|W|), but dW can, so both products are written by the matmul in fp32.

Memory beyond the inputs: one chunk of logits, dH in fp32 (N*H*4 bytes) and, only when
W is trainable, dW in fp32 (V*H*4 bytes), with chunks of up to 1 GiB of logits. With a
frozen lm_head (LoRA) only the first two.

Reference: kernels.references.fused_linear_cross_entropy_reference.
"""
import torch
import torch.nn.functional as F

from kernels.cross_entropy import cross_entropy_forward, grad_scale
from kernels.references import LossOptions, check_linear_loss_args, reduce_losses
from kernels.token_sum_layouts import token_sum_operands

# The chunk logits take CHUNK_BYTES: for a small model with a large vocabulary they are the largest
# transient of a checkpointed step. But a chunk keeps at least MIN_CHUNK_ROWS rows, as smaller lm_head
# GEMMs cost more time than their memory is worth, and at most MAX_CHUNK_BYTES (512 tokens at V=256k in
# bf16). The measurements behind the three: docs/perf-notes.md, "smaller chunks of logits".
CHUNK_BYTES = 64 * 2**20
MIN_CHUNK_ROWS = 512
MAX_CHUNK_BYTES = 256 * 2**20
# With a trainable W, every chunk adds a [V, H] product into dW (fp32, V*H*4 bytes: 2.2 GiB at
# Gemma 2's V=256k, H=2304): fewer, larger chunks cut that traffic, at 1 GiB of chunk logits.
MAX_CHUNK_BYTES_TRAINABLE_W = 2**30


def chunk_rows(N: int, V: int, itemsize: int, need_dw: bool) -> int:
    """The tokens of one chunk, for N tokens of V logits of `itemsize` bytes."""
    row = V * itemsize
    if need_dw:
        rows = MAX_CHUNK_BYTES_TRAINABLE_W // row
    else:
        rows = min(max(CHUNK_BYTES // row, MIN_CHUNK_ROWS), MAX_CHUNK_BYTES // row)
    return max(1, min(N, rows))


def _matmul_into_fp32(a, b, out, accumulate):
    """out (fp32) = a @ b, or out += a @ b. On CUDA the matmul writes (and adds in) fp32 itself:
    no product is rounded to bf16/fp16, none overflows fp16, and no [V, H] temporary is made.
    On CPU (the tests) the operands are upcast: fp32 math. The products sum over tokens: dW's operands take
    layouts that cuBLAS sums whole (kernels/token_sum_layouts.py)."""
    if out.is_cuda:
        a, b = token_sum_operands(a, b)
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def _forward_chunks(hidden, weight, bias, targets, opts: LossOptions, need_dh, need_dw, need_db):
    """Per-row losses [N] fp32 and the unreduced fp32 gradients (None where not needed)."""
    N, H = hidden.shape
    V = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    dh = torch.zeros(N, H, **f32) if need_dh else None  # zeros: also the answer when N == 0
    dw = torch.zeros(V, H, **f32) if need_dw else None
    db = torch.zeros(V, **f32) if need_db else None
    losses = torch.empty(N, **f32)
    need_grad = need_dh or need_dw or need_db
    rows = chunk_rows(N, V, hidden.element_size(), need_dw)
    for start in range(0, N, rows):
        h = hidden[start:start + rows]  # (C, H)
        logits = F.linear(h, weight, bias)  # (C, V)
        losses[start:start + rows], _ = cross_entropy_forward(
            logits, targets[start:start + rows], ignore_index=opts.ignore_index, softcap=opts.softcap,
            scale=opts.scale, dlogits=logits if need_grad else None)
        # logits now holds G = dloss/dlogits (unreduced)
        if need_dh:
            _matmul_into_fp32(logits, weight, dh[start:start + rows], accumulate=False)  # (C, H)
        if need_dw:
            # summed over tokens and not yet divided by num_targets: past 65504 if it were fp16
            _matmul_into_fp32(logits.t(), h, dw, accumulate=True)  # (V, H)
        if need_db:
            db += logits.sum(0, dtype=torch.float32)  # (V,)
        del logits  # freed before the next chunk's are made: one chunk of logits at a time
    return losses, dh, dw, db


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, num_targets, opts: LossOptions):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if opts.reduction == "none" and (need_dw or need_db):
            raise ValueError("fused_linear_cross_entropy(reduction='none') cannot give the gradient of a trainable "
                             "weight or bias (a per-row grad_output would have to enter the sum over rows). "
                             "Freeze them (requires_grad_(False)) or use reduction='sum'/'mean'.")
        losses, dh, dw, db = _forward_chunks(hidden, weight, bias, targets, opts, need_dh, need_dw, need_db)
        loss, denominator = reduce_losses(losses, targets, num_targets, opts)
        assert loss.dtype == torch.float32, f"loss must be float32, got {loss.dtype}"
        ctx.save_for_backward(dh, dw, db)
        ctx.denominator, ctx.reduction = denominator, opts.reduction
        ctx.dtypes = hidden.dtype, weight.dtype, None if bias is None else bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        s = grad_scale(grad_loss, ctx.denominator, ctx.reduction)  # fp32: 0-dim, or (N, 1) for "none"
        grads = []
        for buf, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if buf is None:
                grads.append(None)
                continue
            assert buf.dtype == torch.float32, f"gradient buffer must be float32, got {buf.dtype}"
            out = torch.empty(buf.shape, dtype=dtype, device=buf.device)
            grads.append(torch.mul(buf, s, out=out))  # scaled in fp32, rounded once
        dh, dw, db = grads
        return dh, dw, db, None, None, None


def fused_linear_cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100, softcap=None, scale=None,
                               reduction="mean", num_targets=None):
    """cross_entropy(hidden @ weight.T + bias, targets, ...) without materializing the logits.

    hidden [N, H], weight [V, H] and bias [V] share one dtype (fp32/bf16/fp16); targets [N] int64.
    Returns an fp32 loss, as cross_entropy does (see kernels/cross_entropy.py)."""
    opts = LossOptions(ignore_index, softcap, scale, reduction)
    check_linear_loss_args(hidden, weight, bias, targets, opts)
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in params):
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, num_targets, opts)
    # no graph will be built (needs_input_grad does not see no_grad()): skip every gradient
    losses, *_ = _forward_chunks(hidden, weight, bias, targets, opts, False, False, False)
    return reduce_losses(losses, targets, num_targets, opts)[0]
