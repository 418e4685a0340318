"""Row-wise FP8 (e4m3) quantization of an activation: each row of x [M, K] with a scale of its own.

References: Micikevicius et al. 2022 "FP8 Formats for Deep Learning" (e4m3: 4 exponent bits, 3 mantissa bits,
largest finite value 448); DeepSeek-AI 2024 "DeepSeek-V3" §3.3 and torchao's float8 "rowwise" recipe (one
scale per token for activations and gradients, both in e4m3).

    s_m = amax_m / 448   (1 where amax_m = 0),   amax_m = max_k |x_mk|        (M,) fp32
    q_mk = e4m3(x_mk / s_m)                                                 (M, K), rounded to nearest even

so that x_mk ≈ s_m · q_mk, and a GEMM on q with the scales as _scaled_mm's per-row scale_a (or per-column
scale_b) gives x W in the output dtype. One program quantizes BLOCK_M rows: a first loop over K finds their
amax, a second divides and stores. x may have any strides (the MLP's H and [dG | dU] are stored transposed);
q is written row-major and contiguous, the layout _scaled_mm takes for its first operand, and for its second
as q.t(). The division is IEEE-exact (`div_rn`), and e4m3 is formed from the fp32 bits (`to_e4m3_bits`), so
the kernel equals the reference bit for bit.

Reference: kernels.references.fp8_quantize_rows_reference.
"""
import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, E4M3

BLOCK_M = 16  # rows per program
BLOCK_K = 256  # columns per loop iteration
NUM_WARPS = 4


@triton.jit
def to_e4m3_bits(x):
    """The bits (uint8) of the e4m3fn value nearest to fp32 x, ties to even; ±448 where |x| rounds past it
    (as the GPU's satfinite conversion), NaN for NaN. Integer arithmetic on x's bits, because Triton's
    interpreter (the CPU tests) converts fp32 to fp8 without carrying the rounding into the exponent; the GPU
    takes these few integer operations at no measurable cost, and they compile for sm_80, which has no fp8
    conversion. It can go when the interpreter rounds as the GPU does and sm_80 is not a target.
    Normals (|x| ≥ 2^-6): the fp32 mantissa rounded to 3 bits, the exponent rebiased from 127 to 7.
    Subnormals: |x| rounded to a multiple of 2^-9 (adding and subtracting 2^23 rounds |x| · 2^9 to an integer)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint32)
    a = tl.abs(x)
    abits = a.to(tl.uint32, bitcast=True)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 0x7E)  # 0x7E: 448
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.where(x != x, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_quantize_rows_kernel(x_ptr, x_row_stride, x_col_stride, q_ptr, s_ptr, M, K,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < M
    x_rows = x_ptr + rows[:, None] * x_row_stride
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * x_col_stride, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    s = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)  # 448: references.E4M3_MAX
    tl.store(s_ptr + rows, s, mask=row_ok)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * x_col_stride, mask=ok, other=0.0).to(tl.float32)
        q = to_e4m3_bits(tl.div_rn(x, s[:, None]))
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=ok)


def fp8_quantize_rows(x):
    """(q, s): x [M, K] (fp32/bf16/fp16, any strides) as q [M, K] e4m3, contiguous, and s [M] fp32, x ≈ s[:, None] q."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"fp8 quantize: x must be a 2-D fp32/bf16/fp16 tensor, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M > 0:
        _fp8_quantize_rows_kernel[(triton.cdiv(M, BLOCK_M),)](x, x.stride(0), x.stride(1), q.view(torch.uint8), s, M,
                                                              K, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return q, s

