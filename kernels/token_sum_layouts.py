"""The operands of a GEMM that sums over tokens (a weight's gradient: dW = dYᵀ X, LoRA's dB = dYᵀ (s X Aᵀ) and
dA = (s dY B)ᵀ X, the head's dW = Gᵀ H), in layouts that cuBLAS sums whole.

cuBLAS loses the last term of K, or the last few, for some K when `a` is column-major and `b` row-major (dYᵀ as a
view of dY, X as stored) and the product is thin or of medium size: M or N below ~1000 (LoRA's rank, small models'
projections). The other three layouts lost no term where measured. A lost token's term is 1-4% of the gradient's
largest value, so the smaller operand is copied into the other layout first: for LoRA a copy of r × K values. Which
K, shapes and versions: dev/perf-notes.md, "cuBLAS loses a token".
"""
import torch


def stored_transposed(x: torch.Tensor) -> bool:
    """Whether x [M, K] is stored [K × M], column-major (dYᵀ as a view of dY; the MLP's H and [dG | dU])."""
    return x.stride(0) == 1 and x.stride(1) != 1


def token_sum_operands(a: torch.Tensor, b: torch.Tensor):
    """(a, b) for a @ b with K the tokens: on CUDA, with `a` column-major and `b` row-major, the smaller of the two
    as a copy in the other layout (a row-major, or b column-major); else both as given."""
    if a.is_cuda and stored_transposed(a) and b.stride(1) == 1:
        return (a.contiguous(), b) if a.numel() <= b.numel() else (a, b.t().contiguous().t())
    return a, b
