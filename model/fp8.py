"""FP8 base GEMMs (`--fp8`): the frozen projections' forward GEMM Y = X Wᵀ and input-gradient GEMM dX = dY W run
on FP8 tensor cores (torch._scaled_mm, e4m3); the LoRA path, the norms, attention and the rest stay in bf16.

References: Micikevicius et al. 2022 "FP8 Formats for Deep Learning"; DeepSeek-AI 2024 "DeepSeek-V3" §3.3
(activations and their gradients in e4m3 with fine-grained scales); torchao `float8` (its "rowwise" recipe:
one scale per row of each GEMM operand).

Every operand has one fp32 scale per row of the GEMM's reduction, s = amax / 448 (1 for an all-zero row):

    Y  = X Wᵀ:   _scaled_mm(e4m3(X / s_X), e4m3(W / s_W)ᵀ, scale_a=s_X (N, 1), scale_b=s_W (1, out))
    dX = dY W:   _scaled_mm(e4m3(dY / s_dY), e4m3(Wᵀ / s_Wᵀ)ᵀ, scale_a=s_dY (N, 1), scale_b=s_Wᵀ (1, in))

s_X, s_dY: per token, from each pass's amax (kernels/fp8_quantize.py on CUDA, its torch reference elsewhere),
where the operand is stored row-major (x and dY of q/k/v, o, down; x of gate/up). Where it is stored transposed,
[features × tokens] (the MLP's H, the input of down, and [dG | dU], the dY of gate/up: see model/lora.py), a
token's amax would be a reduction across the strided dimension; there the whole tensor takes one scale, from
one amax over it (torchao's "tensorwise" recipe; kernels/fp8_quantize_tensor.py), which the activation's kernels
find as they write H and [dG | dU] (kernels/glu.py), so that one pass reads them, in their stored layout; that
pass over [dG | dU] is the adapters' one read of it (kernels/adapter_grads.py), where that kernel runs.
_scaled_mm still gets it as a per-token scale_a (the one value in every row), so that W keeps its per-row scales
and the GEMMs are the same.
s_W: per output row of W; s_Wᵀ: per input column of W, for the copy Wᵀ [in, out] that the input gradient reads
(_scaled_mm's second operand is column-major, so dY W needs Wᵀ stored row-major). Projections that share an
input (q, k, v; gate, up) share one [Σout, in] W and one [in, Σout] Wᵀ, whose column scales span the group.

Where W comes from:
- a bf16 base: quantized once at load (`quantize_fp8_`); the e4m3 W and Wᵀ replace the bf16 weight.
- an NF4 base (--quantize nf4): per pass, straight from NF4 by kernels/nf4_to_fp8.py (no bf16 copy), the whole
  group in one launch, into a temporary freed after its GEMM, as the bf16 path's dequantized weights are. Its
  scales and their reciprocals (what the kernel multiplies by) are set at load, the scales from
  the NF4 block absmaxes, without a pass over the weight: |W_rk| ≤ |a_b| for the block b that holds W_rk (the
  NF4 levels lie in [-1, 1]), so row r's amax is at most the largest |a_b| of its blocks, and column k's at most
  the largest over rows of the |a_b| that holds it (the largest of the whole weight when rows do not start
  blocks, in-features not a multiple of 64). An upper bound costs range, never overflow.

_scaled_mm takes its first operand row-major and its second column-major (the transpose of a row-major
tensor), with the reduction and output widths multiples of 16. A group whose in-features or Σout are not
stays on the bf16 path, named in one warning at load. The MLP keeps [G | U] and dH stored transposed (see
model/lora.py): those products are computed as W X̂ᵀ, which needs the token count to be a multiple of 16 too;
otherwise the plain product is copied into that layout.

Both GEMMs sum in the tensor cores' own accumulator (use_fast_accum=True; torchao takes it for its forward
GEMM) rather than having cuBLAS add the partial sums into fp32 registers every few K-steps, which is slower. The
error this adds to a product is small beside e4m3's rounding of the operands (time and error on 7-9B shapes in
dev/benchmarks-history.md, section 36, "`--fp8` with fast accumulation"; tests/test_fp8_gpu.py bounds it at K =
4096 and 28672).

Why e4m3 for dY too (not e5m2, the classic choice for gradients): with a scale per token, the range a row
needs is its own, and e4m3's extra mantissa bit halves the rounding error, as DeepSeek-V3 and torchao's
rowwise recipe do. [dG | dU], with one scale, fits all tokens into e4m3's range: values below 2^-6 / 448 of the
tensor's amax (3.5e-5) keep fewer than 3 mantissa bits, and those below 2^-10 / 448 of it (2.2e-6) round to zero.
"""
import warnings
from functools import lru_cache

import torch
import torch.nn as nn

from kernels.references import (
    E4M3,
    fp8_quantize_rows_reference,
    fp8_quantize_tensor_reference,
    fp8_reciprocal,
    fp8_scale,
    nf4_block_absmax,
    nf4_to_fp8_reference,
    residual_lowrank_add_reference,
)
from kernels.token_sum_layouts import stored_transposed

ALIGN = 16  # _scaled_mm's multiple for the reduction and output widths


def unavailable(device=None) -> str | None:
    """Why this torch cannot run the fp8 GEMMs (on `device`, where given), or None."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm for float8_e4m3fn"
    if device is not None and torch.device(device).type == "cpu" and not _cpu_rowwise():
        return (f"torch {torch.__version__}'s CPU torch._scaled_mm takes one scale a tensor, not the per-row scales "
                f"these GEMMs use (torch 2.13's takes them)")
    return None


@lru_cache
def _cpu_rowwise() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes per-row scales (some builds assert one scale a tensor)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def quantize_rows(x):
    """(q, s): x [M, K] as e4m3 [M, K] row-major with one fp32 scale per row (M,), x ≈ s[:, None] · q."""
    if x.is_cuda:
        from kernels.fp8_quantize import fp8_quantize_rows  # Triton is imported only where the kernel runs
        return fp8_quantize_rows(x)
    return fp8_quantize_rows_reference(x)


def add_residual_and_adapter_(y, residual, p, b):
    """y += residual + p bᵀ in one pass, and returns y: an fp8 GEMM's output (o, down) with the residual stream and
    the adapter's product (p = s X Aᵀ, b = B), since _scaled_mm takes no addend to fold the residual into as the
    bf16 path's GEMM does (kernels/residual_lowrank_add.py on CUDA, its reference elsewhere)."""
    if y.is_cuda:
        from kernels.residual_lowrank_add import residual_lowrank_add_  # Triton is imported only where it runs
        return residual_lowrank_add_(y, residual, p, b)
    return residual_lowrank_add_reference(y, residual, p, b)


def quantize_activation(x, amax=None):
    """(q, s): an activation or gradient x [M, K] as e4m3 [M, K] row-major with fp32 scales s (M,): one per row
    where x is row-major, one for the whole tensor (in every row) where x is stored transposed, from `amax` (max
    |x|, 0-d) where given."""
    if not stored_transposed(x):
        return quantize_rows(x)
    if x.is_cuda:
        from kernels.fp8_quantize_tensor import fp8_quantize_tensor  # Triton is imported only where the kernel runs
        return fp8_quantize_tensor(x, amax)
    return fp8_quantize_tensor_reference(x, amax)


class FP8Weights(nn.Module):
    """The e4m3 base weights of projections that read one input, [W_1; W_2; ...] (Σout, in), for the fp8 GEMMs:
    its row scales `scale` (Σout,), the column scales `scale_t` (in,) of its transposed copy, and, for a bf16
    base, the e4m3 `weight` (Σout, in) and `weight_t` (in, Σout) themselves. For an NF4 base, made per pass,
    `weight` and `weight_t` are None and the scales' reciprocals `reciprocal` and `reciprocal_t`, which the
    kernel multiplies by, are kept instead. Every projection of the group holds this one module as its `fp8`."""

    def __init__(self, projs):
        super().__init__()
        self.names = [p.name for p in projs]
        ends = [sum(p.out_features for p in projs[:i + 1]) for i in range(len(projs))]
        self.spans = {p.name: slice(e - p.out_features, e) for p, e in zip(projs, ends)}
        self.weight_dtype = None  # a bf16 base's dtype, for `dequantize`
        if projs[0].nf4 is not None:
            bounds = [nf4_bounds(p.nf4) for p in projs]
            scale = fp8_scale(torch.cat([rows for rows, _ in bounds]))
            scale_t = fp8_scale(torch.stack([cols for _, cols in bounds]).amax(0))
            weight = weight_t = None
            reciprocal, reciprocal_t = fp8_reciprocal(scale), fp8_reciprocal(scale_t)  # once, not every pass
        else:
            w = torch.cat([p.weight for p in projs]) if len(projs) > 1 else projs[0].weight  # (Σout, in)
            self.weight_dtype = w.dtype
            weight, scale = quantize_rows(w)
            weight_t, scale_t = quantize_rows(w.t())  # (in, Σout): one scale per column of W
            reciprocal = reciprocal_t = None
        for name, t in (("weight", weight), ("scale", scale), ("weight_t", weight_t), ("scale_t", scale_t),
                        ("reciprocal", reciprocal), ("reciprocal_t", reciprocal_t)):
            self.register_buffer(name, t, persistent=False)  # made from the checkpoint's weights at every load

    def dequantize(self, name):
        """Projection `name`'s rows of a bf16 base's e4m3 W times their scales, in the base's dtype: what the
        unfused path, DoRA's norms and merges read for a base that is only stored in fp8."""
        rows = self.spans[name]
        return (self.weight[rows].float() * self.scale[rows, None]).to(self.weight_dtype)

    def extra_repr(self):
        return f"{'/'.join(self.names)}, {'nf4 per pass' if self.weight is None else 'e4m3'}"


def nf4_bounds(nf4):
    """Upper bounds of |W| per row (out,) and per column (in,) of an NF4Weight, from its block absmaxes alone
    (see the module docstring)."""
    R, K = nf4.shape
    a = nf4_block_absmax(nf4.data()).abs()  # (n_blocks,)
    r = torch.arange(R, device=a.device)
    first, last = r * K // 64, ((r + 1) * K - 1) // 64  # the blocks that row r's values lie in
    blocks = torch.minimum(first[:, None] + torch.arange(-(-K // 64) + 1, device=a.device), last[:, None])
    rows = a[blocks].amax(1)
    cols = a.view(R, K // 64).amax(0).repeat_interleave(64) if K % 64 == 0 else a.amax().expand(K)
    return rows, cols.contiguous()


def fits(projs) -> bool:
    """Whether _scaled_mm takes the group's shapes: in-features and Σout multiples of 16."""
    return projs[0].in_features % ALIGN == 0 and sum(p.out_features for p in projs) % ALIGN == 0


@torch.no_grad()
def quantize_fp8_(groups):
    """Give every group of projections (those that read one input) its FP8Weights; a bf16 base's weights are
    then dropped. A group whose shapes _scaled_mm does not take stays on the bf16 path: one warning names them
    all. Raises ValueError for a base weight that trains (the fp8 GEMMs give no weight gradient)."""
    groups = list(groups)
    first = groups[0][0] if groups else None
    device = None if first is None else (first.weight if first.nf4 is None else first.nf4.packed).device
    if reason := unavailable(device):
        warnings.warn(f"fp8: {reason}; the base GEMMs stay in the model dtype", stacklevel=2)
        return
    skipped = []
    for projs in groups:
        if any(p.weight is not None and p.weight.requires_grad for p in projs):
            raise ValueError("fp8 base GEMMs need a frozen base: the fp8 path gives no gradient for W (--full)")
        if not fits(projs):
            skipped.append(f"{'/'.join(p.name for p in projs)} ({projs[0].in_features} -> "
                           f"{sum(p.out_features for p in projs)})")
            continue
        fp8 = FP8Weights(projs)
        for p in projs:
            p.fp8 = fp8
            if p.nf4 is None:
                p.weight = None
    if skipped:
        warnings.warn(f"fp8: {len(skipped)} projection group(s) stay in the model dtype, their widths not multiples "
                      f"of {ALIGN} as torch._scaled_mm needs: {', '.join(dict.fromkeys(skipped))}", stacklevel=2)


# ----------------------------------------------------------------------------- the GEMMs (model/lora.py calls them)

def _weights(projs, transposed):
    """(e4m3 weight, its row scales): [W_1; W_2; ...] (Σout, in) with s_W (Σout,), or transposed its copy
    (in, Σout) with s_Wᵀ (in,). A bf16 base's are stored; an NF4 base's are made here, freed after use."""
    fp8 = projs[0].fp8
    assert [p.name for p in projs] == fp8.names and all(p.fp8 is fp8 for p in projs), (
        f"fp8: projections {[p.name for p in projs]} do not match their fp8 group {fp8.names}")
    scale = fp8.scale_t if transposed else fp8.scale
    if fp8.weight is not None:
        return (fp8.weight_t if transposed else fp8.weight), scale
    K, total = projs[0].in_features, len(fp8.scale)
    w = torch.empty((K, total) if transposed else (total, K), dtype=E4M3, device=scale.device)
    if w.is_cuda:
        from kernels.nf4_to_fp8 import nf4_to_fp8  # Triton is imported only where the kernel runs
        nf4_to_fp8([(p.nf4.data(), p.nf4.shape) for p in projs], fp8.reciprocal_t if transposed else fp8.reciprocal,
                   w, transposed)
        return w, scale
    for p in projs:
        rows = fp8.spans[p.name]
        out, s = (w[:, rows], scale) if transposed else (w[rows], scale[rows])
        out.copy_(nf4_to_fp8_reference(p.nf4.data(), p.nf4.shape, s, transposed))
    return w, scale


def _check_operands(a, b):
    """_scaled_mm's layouts, checked here because a CPU build may accept what the GPU refuses: a row-major,
    b column-major (the transpose of a row-major tensor), e4m3, the reduction and b's width multiples of 16."""
    assert a.dtype == E4M3 and b.dtype == E4M3, f"fp8 GEMM: operands must be e4m3, got {a.dtype}, {b.dtype}"
    assert a.stride(1) == 1 and a.stride(0) == a.shape[1], f"fp8 GEMM: a must be row-major, got {a.stride()}"
    assert b.stride(0) == 1 and b.stride(1) == b.shape[0], f"fp8 GEMM: b must be column-major, got {b.stride()}"
    assert a.shape[1] % ALIGN == 0 and b.shape[1] % ALIGN == 0, f"fp8 GEMM: {tuple(a.shape)} @ {tuple(b.shape)}"


def _mm(a, sa, w, sw, dtype, transposed):
    """(s_a a)(s_w w)ᵀ (M, n) in `dtype`, for a (M, K) and w (n, K) e4m3 row-major with per-row fp32 scales.
    transposed: computed as the contiguous (n, M) product w aᵀ and returned transposed (the MLP's layouts),
    where M is a multiple of 16; else the plain product, copied into that layout (one row needs no copy)."""
    M = a.shape[0]
    if transposed and M % ALIGN == 0:
        b = a.t()
        _check_operands(w, b)
        y = torch._scaled_mm(w, b, scale_a=sw[:, None], scale_b=sa[None, :], out_dtype=dtype,
                             use_fast_accum=True).t()
    else:
        b = w.t()
        _check_operands(a, b)
        y = torch._scaled_mm(a, b, scale_a=sa[:, None], scale_b=sw[None, :], out_dtype=dtype, use_fast_accum=True)
        if transposed and M > 1:
            y = y.t().contiguous().t()
    assert y.dtype == dtype, f"fp8 GEMM: output must be {dtype}, got {y.dtype}"
    return y


def fp8_linear(projs, x, dtype, transposed=False, amax=None):
    """X [W_1; W_2; ...]ᵀ (N, Σout) in `dtype`, without biases, from x (N, in) in `dtype`: one fp8 GEMM. amax:
    max |x| where the caller has it (`quantize_activation`)."""
    assert x.dtype == dtype, f"fp8 GEMM: x must be {dtype}, got {x.dtype}"
    w, sw = _weights(projs, transposed=False)
    a, sa = quantize_activation(x, amax)
    return _mm(a, sa, w, sw, dtype, transposed)


def fp8_input_grad(projs, dy, transposed=False, amax=None, quantized=None):
    """dY [W_1; W_2; ...] (N, in) in dY's dtype, from dY (N, Σout): one fp8 GEMM with the transposed copy. amax:
    max |dY| where the caller has it (`quantize_activation`); quantized: (q, s), dY's e4m3 copy as
    `quantize_activation` gives it, where the caller made it (the MLP adapters' one read, kernels/adapter_grads.py)."""
    w, sw = _weights(projs, transposed=True)
    a, sa = quantize_activation(dy, amax) if quantized is None else quantized
    return _mm(a, sa, w, sw, dy.dtype, transposed)
