"""Tensor-wise FP8 (e4m3) quantization of an activation: all of x [M, K] with one scale, for the operands that are
stored transposed (the MLP's H and [dG | dU], [K × M] in memory), where a scale per row would be a reduction
across the strided dimension.

References: Micikevicius et al. 2022 "FP8 Formats for Deep Learning"; torchao's float8 "tensorwise" recipe
(one scale per tensor, from its amax).

    s = amax / 448   (1 where that is below 2^-126),   amax = max_mk |x_mk|               () fp32
    q_mk = e4m3(x_mk · r),   r = 1 / s                                                  (M, K), nearest even

Two passes, each reading x in the layout it is stored in, whole memory segments at a time: amax, a plain
reduction (torch.linalg.vector_norm with ord inf, one read of x and no temporary; none where the kernel that
wrote x found it, as the MLP's activation kernels do, kernels/glu.py), then this kernel, which
multiplies each value by r and converts it, in (BLOCK_M, BLOCK_K) tiles. q is written [M, K] row-major: an fp8
GEMM reads both operands along the reduction, K, so the stored [K × M] layout cannot serve; the tile is
transposed on chip, and the write stays coalesced. s and r are the IEEE-exact fp32 quotients of
kernels/fp8_quantize.py (`fp8_scale_and_reciprocal`), and the conversion its `e4m3_bits`, so the kernel equals
kernels.references.fp8_quantize_tensor_reference bit for bit.

The scale is returned once per row, s [M] (all equal): the row-wise scale_a that torch._scaled_mm pairs with W's
row scales, and which it takes only contiguous (an expanded view is refused).

Reference: kernels.references.fp8_quantize_tensor_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.fp8_quantize import MIN_SCALE, e4m3_bits, fp8_scale_and_reciprocal, hardware_e4m3
from kernels.references import DTYPES, E4M3

BLOCK = (64, 64)  # (BLOCK_M, BLOCK_K): 64 contiguous values along either dimension, read and written
NUM_WARPS = 4


@triton.jit
def _fp8_quantize_tensor_kernel(x_ptr, x_row_stride, x_col_stride, amax_ptr, q_ptr, s_ptr, M, K,
                                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                                MIN_SCALE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    s, r = fp8_scale_and_reciprocal(tl.load(amax_ptr).to(tl.float32), MIN_SCALE)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + rows, tl.full((BLOCK_M,), 1.0, tl.float32) * s, mask=rows < M)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=ok, other=0.0)
    x = x.to(tl.float32)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], e4m3_bits(x * r, HARDWARE_E4M3), mask=ok)


def fp8_quantize_tensor(x, amax=None):
    """(q, s): x [M, K] (fp32/bf16/fp16, any strides) as q [M, K] e4m3, contiguous, with one fp32 scale for the
    whole tensor, given once per row: s [M], x ≈ s[:, None] q. amax: max |x| (0-d, in x's dtype) where the caller
    has it (the MLP's activation kernels find it as they write x: kernels/glu.py); else found here."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"fp8 quantize: x must be a 2-D fp32/bf16/fp16 tensor, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device)
    if x.numel() == 0:
        return q, torch.ones(M, dtype=torch.float32, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if amax is None:
        amax = torch.linalg.vector_norm(x, float("inf"))  # max |x|, exact in x's dtype
    assert amax.shape == () and amax.dtype == x.dtype, f"fp8 quantize: amax must be 0-d {x.dtype}, got {amax.dtype}"
    block_m, block_k = BLOCK
    _fp8_quantize_tensor_kernel[(triton.cdiv(M, block_m), triton.cdiv(K, block_k))](
        x, x.stride(0), x.stride(1), amax, q.view(torch.uint8), s, M, K, BLOCK_M=block_m, BLOCK_K=block_k,
        HARDWARE_E4M3=hardware_e4m3(x.device), MIN_SCALE=MIN_SCALE, num_warps=NUM_WARPS)
    return q, s
