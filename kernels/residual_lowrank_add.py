"""The output of an fp8 projection that adds into the residual stream (o, down), finished in one pass: the base
GEMM's Y (N, C), the residual R (N, C) and the LoRA adapter's product P Bᵀ, P = s X Aᵀ (N, k), B (C, k):

    Y ← Y + R + P Bᵀ            (fp32 in registers, one rounding at the store)

torch._scaled_mm takes no addend (cuBLAS's β·C), so without this the fp8 path adds R in one pass over Y and
P Bᵀ in another (addmm_, which reads and writes Y again); here Y and R are read once and Y is written once. A
program takes a BLOCK_R × BLOCK_C tile; P Bᵀ over it is a tensor-core product along k (kernels/glu.py's
`lowrank_term`), its P and B small enough to come from L2.

Reference: kernels.references.residual_lowrank_add_reference.
"""
import triton
import triton.language as tl

from kernels.decode_linear import dot_constexprs
from kernels.glu import lowrank_term, rank_blocks, term_right
from kernels.references import check_residual_lowrank_add_args

BLOCK_R, BLOCK_C, NUM_WARPS = 64, 128, 4


@triton.jit
def _residual_lowrank_add_kernel(y_ptr, y_row_stride, r_ptr, r_row_stride, term, n_rows, n_cols,
                                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                                 K_CHUNKS: tl.constexpr, DTYPE: tl.constexpr, OPERAND: tl.constexpr,
                                 PRECISION: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    y_offs = rows[:, None].to(tl.int64) * y_row_stride + cols[None, :]
    y = tl.load(y_ptr + y_offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows[:, None].to(tl.int64) * r_row_stride + cols[None, :], mask=mask, other=0.0)
    right = term_right(term, cols, n_cols, 0, BLOCK_K)
    y += r.to(tl.float32) + lowrank_term(term, right, rows, cols, n_rows, n_cols, BLOCK_R, BLOCK_C, BLOCK_K, K_CHUNKS,
                                         DTYPE, OPERAND, PRECISION)
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def residual_lowrank_add_(y, residual, p, b):
    """y += residual + p bᵀ in place, and returns y: y and residual (N, C) with unit column strides, p (N, k) and
    b (C, k), all of one dtype (fp32/bf16/fp16) on one device."""
    check_residual_lowrank_add_args(y, residual, p, b)
    N, C = y.shape
    k = p.shape[1]
    if y.numel() == 0:
        return y
    block_k, chunks = rank_blocks(k)
    term = (p, p.stride(0), p.stride(1), b, b.stride(0), b.stride(1), k)
    grid = (triton.cdiv(C, BLOCK_C), triton.cdiv(N, BLOCK_R))
    _residual_lowrank_add_kernel[grid](y, y.stride(0), residual, residual.stride(0), term, N, C, BLOCK_R=BLOCK_R,
                                       BLOCK_C=BLOCK_C, BLOCK_K=block_k, K_CHUNKS=chunks, **dot_constexprs(y),
                                       num_warps=NUM_WARPS)
    return y
