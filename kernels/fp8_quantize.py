"""Row-wise FP8 (e4m3) quantization of an activation: each row of x [M, K] with a scale of its own.

References: Micikevicius et al. 2022 "FP8 Formats for Deep Learning" (e4m3: 4 exponent bits, 3 mantissa bits,
largest finite value 448); DeepSeek-AI 2024 "DeepSeek-V3" §3.3 and torchao's float8 "rowwise" recipe (one
scale per token for activations and gradients, both in e4m3).

    s_m = amax_m / 448   (1 where that is below 2^-126),   amax_m = max_k |x_mk|       (M,) fp32
    q_mk = e4m3(x_mk · r_m),   r_m = 1 / s_m                                        (M, K), rounded to nearest even

so that x_mk ≈ s_m · q_mk, and a GEMM on q with the scales as _scaled_mm's per-row scale_a (or per-column
scale_b) gives x W in the output dtype. s_m and r_m are IEEE-exact fp32 quotients (`div_rn`), one pair a row;
each value costs one fp32 multiply, as kernels.references.fp8_quantize_rows_reference computes it, so the
kernel equals the reference bit for bit.

A row of up to MAX_ONE_PASS values is read once, held in registers while its amax is found; a wider one is read
twice (amax, then quantize). x may have any strides: a row-major x is read along its rows, one stored transposed
(W's transposed copy Wᵀ, quantized once at load; the activations stored so take one scale for the tensor,
kernels/fp8_quantize_tensor.py) in tiles of BLOCK_M rows along its contiguous dimension, so that both read
whole memory segments. q is written row-major and contiguous, the layout _scaled_mm takes for its first operand, and
for its second as q.t().

e4m3 comes from the GPU's conversion (cvt.rn.satfinite, sm_89+) after a clamp to ±448 (exact, and saturating
as the reference does), or, where that is missing, from the fp32 bits (`to_e4m3_bits`): in Triton's
interpreter (the CPU tests), whose fp32-to-fp8 cast rounds wrongly, and on sm_80.

Reference: kernels.references.fp8_quantize_rows_reference.
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, E4M3

MAX_ONE_PASS = 8192  # the widest row (a power of two) held in registers: one read of x
WIDE_BLOCK = (4, 1024)  # (BLOCK_M, BLOCK_K) of a row-major x wider than that: two reads
TRANSPOSED_BLOCK = (64, 64)  # (BLOCK_M, BLOCK_K) of an x stored transposed: 64 contiguous values a column
MIN_SCALE = 2.0**-126  # fp32's smallest normal: a smaller scale is 1 (references.fp8_scale)


@triton.jit
def to_e4m3_bits(x):
    """The bits (uint8) of the e4m3fn value nearest to fp32 x, ties to even; ±448 where |x| rounds past it
    (as the GPU's satfinite conversion), NaN for NaN. Integer arithmetic on x's bits, for where there is no
    hardware conversion to use: Triton's interpreter (the CPU tests), whose fp32-to-fp8 cast does not carry the
    rounding into the exponent, and sm_80.
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
def e4m3_bits(x, HARDWARE_E4M3: tl.constexpr):
    """The bits (uint8) of e4m3(x) for fp32 x, nearest even, saturating at ±448: the GPU's conversion after an
    exact clamp (NaN passes through), or, without hardware e4m3, `to_e4m3_bits`, which gives the same bits."""
    if HARDWARE_E4M3:
        x = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)  # 448: references.E4M3_MAX
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return to_e4m3_bits(x)


@triton.jit
def fp8_scale_and_reciprocal(amax, MIN_SCALE: tl.constexpr):
    """(s, 1 / s): s = amax / 448, 1 where that is below MIN_SCALE; both IEEE-exact quotients."""
    s = tl.div_rn(amax, 448.0)
    s = tl.where(s >= MIN_SCALE, s, 1.0)
    return s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _fp8_quantize_rows_kernel(x_ptr, x_row_stride, x_col_stride, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                              MIN_SCALE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_ok = rows < M
    x_rows = x_ptr + rows[:, None] * x_row_stride
    q_rows = q_ptr + rows[:, None] * K
    if ONE_PASS:  # BLOCK_K ≥ K: the rows in registers, x read once
        cols = tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * x_col_stride, mask=ok, other=0.0).to(tl.float32)
        s, r = fp8_scale_and_reciprocal(tl.max(tl.abs(x), axis=1), MIN_SCALE)
        tl.store(s_ptr + rows, s, mask=row_ok)
        tl.store(q_rows + cols[None, :], e4m3_bits(x * r[:, None], HARDWARE_E4M3), mask=ok)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (cols[None, :] < K)
            x = tl.load(x_rows + cols[None, :] * x_col_stride, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        s, r = fp8_scale_and_reciprocal(amax, MIN_SCALE)
        tl.store(s_ptr + rows, s, mask=row_ok)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (cols[None, :] < K)
            x = tl.load(x_rows + cols[None, :] * x_col_stride, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_rows + cols[None, :], e4m3_bits(x * r[:, None], HARDWARE_E4M3), mask=ok)


@lru_cache
def hardware_e4m3(device) -> bool:
    """Whether the kernels convert to e4m3 with the GPU's instruction on `device` (CUDA, sm_89 or newer); else
    they form it from the fp32 bits (Triton's interpreter on the CPU, sm_80)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def launch_config(M, K, transposed):
    """(BLOCK_M, BLOCK_K, ONE_PASS, num_warps) for x [M, K], stored row-major or `transposed` (column-major)."""
    if transposed:
        block_m, block_k = TRANSPOSED_BLOCK
        return block_m, block_k, K <= block_k, 4
    block_k = triton.next_power_of_2(max(K, 1))
    if block_k > MAX_ONE_PASS:
        return *WIDE_BLOCK, False, 8
    block_m = max(1, 2048 // block_k)  # at least 2048 values a program
    return block_m, block_k, True, 8 if block_k >= 4096 else 4


def fp8_quantize_rows(x):
    """(q, s): x [M, K] (fp32/bf16/fp16, any strides) as q [M, K] e4m3, contiguous, and s [M] fp32, x ≈ s[:, None] q."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"fp8 quantize: x must be a 2-D fp32/bf16/fp16 tensor, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=E4M3, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M > 0:
        block_m, block_k, one_pass, num_warps = launch_config(M, K, x.stride(0) == 1 and x.stride(1) != 1)
        _fp8_quantize_rows_kernel[(triton.cdiv(M, block_m),)](
            x, x.stride(0), x.stride(1), q.view(torch.uint8), s, M, K, BLOCK_M=block_m, BLOCK_K=block_k,
            ONE_PASS=one_pass, HARDWARE_E4M3=hardware_e4m3(x.device), MIN_SCALE=MIN_SCALE, num_warps=num_warps)
    return q, s
