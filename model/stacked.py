"""Projections that read one input and train their base weights (full fine-tuning), as one GEMM each way.

For projections whose weights W_i [out_i, in] (and biases b_i) all train, and that carry no adapter (q, k, v
together, or any one alone: model/transformer.py `project`), with
W = [W_1; W_2; ...] (Σout, in) and b = [b_1 | b_2 | ...] (Σout,):

    Y  = X Wᵀ + b          (N, Σout)   one GEMM; Y_i its columns
    dX = dY W              (N, in)     one GEMM, where each projection apart takes one and a sum costs an add
    dW = dYᵀ X             (Σout, in)  one GEMM; dW_i its rows
    db = Σ_n dY            (Σout,)     one reduction; db_i its entries

W is read without a copy: `pack_weights_` (model/lora.py) stores the weights of a group that trains as consecutive
rows of one tensor, and `Masters` (masters.py) keeps them consecutive in its flat buffers, so they stay one strided
view (`stacked`). Each weight's gradient is its rows of dW, and autograd accumulates it into the weight's .grad.
dW's operands take layouts that cuBLAS sums whole (kernels/token_sum_layouts.py), where F.linear's own backward
may lose a token's term.

Only q, k, v take this path as a group. Gate and up stay two projections: the GLU kernels (kernels/glu.py) read G
and U as flat contiguous tensors, and take column slices of one (N, 2I) output only through a copy of each (forward
and backward), which costs more than the one add of their dX it would save. The fused LoRA MLP avoids that by working
transposed throughout (model/lora.py, `_LoRAMLP`), which a plain autograd MLP cannot: its dH would reach the
kernels transposed and be copied.
"""
import torch
import torch.nn.functional as F

from model.lora import _mm_to, _rows_view, compute_dtype


def stacked(projs):
    """Whether the projections take `stacked_projections`: each trains its weight (and bias, where it has one), has
    no adapter and a full-precision weight, and the weights (and biases) are rows of one tensor, one after another."""
    for p in projs:
        if p.r or p.nf4 is not None or p.fp8 is not None or p.merged is not None or p.weight is None:
            return False
        if not p.weight.requires_grad or (p.bias is not None and not p.bias.requires_grad):
            return False
    biases = [p.bias for p in projs]
    if len({b is None for b in biases}) > 1:
        return False
    return _rows_view([p.weight for p in projs]) is not None and (biases[0] is None or _rows_view(biases) is not None)


class _StackedLinear(torch.autograd.Function):
    """[Y_1 | Y_2 | ...] (N, Σout), Y_i = X W_iᵀ + b_i, for n projections: params are the weights W_1 ... W_n, then
    the biases b_1 ... b_n where the projections have them; see the module docstring."""

    @staticmethod
    def forward(ctx, x, n, *params):
        dtype = compute_dtype(x)
        for t in params:
            assert t.dtype == params[0].dtype, f"stacked projections: weights of one dtype, got {t.dtype}"
        weights, biases = params[:n], params[n:]
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            b = _rows_view(biases).to(dtype) if biases else None
            y = F.linear(xc, _rows_view(weights).to(dtype), b)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.w_dtype, ctx.bias = x.dtype, params[0].dtype, bool(biases)
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, *weights = ctx.saved_tensors
        assert dy.dtype == xc.dtype, f"stacked projections: the output's gradient must be {xc.dtype}, got {dy.dtype}"
        rows = [len(w) for w in weights]
        need_x = ctx.needs_input_grad[0]
        with torch.autocast(xc.device.type, enabled=False):
            dx = torch.mm(dy, _rows_view(weights).to(dy.dtype)).to(ctx.x_dtype) if need_x else None  # (N, in)
            dw = _mm_to(dy.t(), xc, ctx.w_dtype)  # (Σout, in), summing every token
            db = dy.sum(0).to(ctx.w_dtype) if ctx.bias else None  # (Σout,)
        dbs = db.split(rows) if db is not None else ()
        return (dx, None, *dw.split(rows), *dbs)


def stacked_projections(x, projs):
    """tuple(p(x) for p in projs) for projections that `stacked` admits, as one autograd Function. x (..., in);
    the outputs are column slices of one (..., Σout) tensor."""
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    params = [p.weight for p in projs] + [p.bias for p in projs if p.bias is not None]
    y = _StackedLinear.apply(x2, len(projs), *params)
    return y.view(*x.shape[:-1], y.shape[-1]).split([p.out_features for p in projs], dim=-1)
