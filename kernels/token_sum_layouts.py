"""The operands of a GEMM that sums over tokens (a weight's gradient: dW = dYᵀ X, LoRA's dB = dYᵀ (s X Aᵀ) and
dA = (s dY B)ᵀ X, the head's dW = Gᵀ H), in layouts that cuBLAS sums whole.

cuBLAS loses the last term of K, or the last few, for some K when `a` is column-major and `b` row-major (dYᵀ as a
view of dY, X as stored) and the product is thin or of medium size: M or N below ~1000 (LoRA's rank, SmolLM2's and
Qwen2.5-0.5B's projections). Measured on an H200 with torch 2.11 and CUDA 13.0, bf16: every K ≡ 1 mod 128 from
2561 at rank 16 (4097, 6145, ...), more K at other widths, none at 1024 × 4096 and above, and none in the other
three layouts (dev/perf-notes.md, "cuBLAS loses a token"). A lost token's term is 1-4% of the gradient's largest
value. So the smaller operand is copied into the other layout first: for LoRA a copy of r × K values.
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
