"""NF4 weights (double-quantized absmax) straight to FP8 (e4m3) with given scales, row-major or transposed.

References: kernels/nf4_dequantize.py (the NF4 format and its dequantization, bit-equal to bitsandbytes'
`dequantize_4bit`); kernels/fp8_quantize.py (e4m3, and its rounding).

A weight W [R, K] stored as NF4 (kernels.references.NF4Data) has values, in fp32,

    W_rk = NF4[q_i] · a_{i // 64},   a_b = D[c_b] · s_{b // 256} + o,   i = r K + k

computed as nf4_dequantize computes them (no fused multiply-add, so W_rk is bitsandbytes' fp32 value). This
kernel writes them as e4m3 without a bf16 copy in between:

    row-wise:    out[r, k] = e4m3(W_rk / scale_r)     scale (R,): W's rows, the forward GEMM's operand X Wᵀ
    transposed:  out[k, r] = e4m3(W_rk / scale_k)     scale (K,): Wᵀ's rows, the input gradient's dY W

The division by the scale is a multiply by its reciprocal, as the reference computes it: the launcher takes
the reciprocals once (kernels.references.fp8_reciprocal, R or K values), as a thread may hold values of many
columns; e4m3 comes from kernels/fp8_quantize.py's `e4m3_bits` (the GPU's
conversion on sm_89+, else the fp32 bits).

`out` may be the rows [r0, r0 + R) of a larger [Σout, K] buffer, or, transposed, the columns [r0, r0 + R) of a
larger [K, Σout] one (the packed q, k, v of model/lora.py): its row stride is an argument. One program
converts a BLOCK_R × BLOCK_K tile of W. Where K is a multiple of 64 (every real model), each tile row holds
whole 64-value blocks: the program reads each block's absmax once and each packed byte once (both nibbles,
joined), as kernels/nf4_dequantize.py does. Otherwise blocks and bytes may straddle rows, and each value
gathers its own. The transposed tile is transposed in registers (`tl.trans`), so that its store runs along
out's contiguous dimension too.

Reference: kernels.references.nf4_to_fp8_reference.
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.fp8_quantize import e4m3_bits, hardware_e4m3
from kernels.references import E4M3, NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4_LEVELS, NF4Data, check_nf4_args, fp8_reciprocal

BLOCK_R, BLOCK_K = 64, 128  # a tile: 64 contiguous bytes of out a row when transposed, 128 when not
# Fusion off: a · s + o is rounded twice, as bitsandbytes rounds it (kernels/nf4_dequantize.py).
OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


@triton.jit
def _block_absmax(block, mask, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                  ABSMAX_BLOCK: tl.constexpr):
    """a_b = D[c_b] · s_{b // 256} + o, fp32, for the block indices `block`."""
    c = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
    s = tl.load(absmax_scale_ptr + block // ABSMAX_BLOCK, mask=mask, other=0.0)
    return tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr)


@triton.jit
def _nf4_to_fp8_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr,
                       rcp_ptr, out_ptr, out_row_stride, R, K, TRANSPOSED: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                       HARDWARE_E4M3: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    k0 = tl.program_id(1).to(tl.int64) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    ok = (r[:, None] < R) & (k[None, :] < K)
    if WHOLE_BLOCKS:  # K % BLOCK == 0 and BLOCK_K % BLOCK == 0: a tile row is BLOCK_K // BLOCK whole blocks
        NB: tl.constexpr = BLOCK_K // BLOCK
        HALF: tl.constexpr = BLOCK // 2  # bytes a block
        block = (r[:, None] * K + k0) // BLOCK + tl.arange(0, NB)[None, :]  # (BLOCK_R, NB)
        block_ok = (r[:, None] < R) & (k0 + tl.arange(0, NB)[None, :] * BLOCK < K)
        a = _block_absmax(block, block_ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                          ABSMAX_BLOCK)[:, :, None]  # (BLOCK_R, NB, 1)
        byte = block[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # (BLOCK_R, NB, HALF)
        p = tl.load(packed_ptr + byte, mask=block_ok[:, :, None], other=0)  # uint8
        high = tl.load(levels_ptr + (p >> 4)) * a  # value 2j
        low = tl.load(levels_ptr + (p & 15)) * a  # value 2j + 1
        w = tl.reshape(tl.join(high, low), (BLOCK_R, BLOCK_K))  # (BLOCK_R, NB, HALF, 2) -> values in order
    else:
        i = r[:, None] * K + k[None, :]  # (BLOCK_R, BLOCK_K): flat index into W
        a = _block_absmax(i // BLOCK, ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                          ABSMAX_BLOCK)
        p = tl.load(packed_ptr + i // 2, mask=ok, other=0)  # uint8: value 2j in the high nibble, 2j + 1 in the low
        w = tl.load(levels_ptr + tl.where(i % 2 == 0, p >> 4, p & 15)) * a
    if TRANSPOSED:
        q = e4m3_bits(w * tl.load(rcp_ptr + k, mask=k < K, other=1.0)[None, :], HARDWARE_E4M3)
        tl.store(out_ptr + k[:, None] * out_row_stride + r[None, :], tl.trans(q), mask=tl.trans(ok))
    else:
        q = e4m3_bits(w * tl.load(rcp_ptr + r, mask=r < R, other=1.0)[:, None], HARDWARE_E4M3)
        tl.store(out_ptr + r[:, None] * out_row_stride + k[None, :], q, mask=ok)


@lru_cache
def _levels(device):
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def nf4_to_fp8(q: NF4Data, shape, scale, out, transposed=False):
    """W [R, K] of `q` into `out` as e4m3 with the fp32 `scale`: out [R, K] and scale (R,) per row, or
    transposed, out [K, R] and scale (K,) per row of Wᵀ. out may be a slice of a larger buffer whose last
    dimension is contiguous (rows of [Σout, K]; columns of [K, Σout]). Returns `out`."""
    R, K = shape
    expected = (K, R) if transposed else (R, K)
    if out.dtype != E4M3 or tuple(out.shape) != expected or out.stride(1) != 1 or out.device != q.packed.device:
        raise ValueError(f"NF4 to fp8: out must be {expected} e4m3 with a contiguous last dimension on "
                         f"{q.packed.device}; got {tuple(out.shape)} {out.dtype}, strides {out.stride()}, "
                         f"on {out.device}")
    n_scales = K if transposed else R
    if scale.dtype != torch.float32 or scale.shape != (n_scales,) or scale.device != out.device:
        raise ValueError(f"NF4 to fp8: scale must be ({n_scales},) fp32 on {out.device}, got {tuple(scale.shape)} "
                         f"{scale.dtype} on {scale.device}")
    check_nf4_args(q, R * K)
    if R * K > 0:
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(K, BLOCK_K))
        _nf4_to_fp8_kernel[grid](q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code,
                                 _levels(out.device), fp8_reciprocal(scale), out.view(torch.uint8), out.stride(0), R, K,
                                 TRANSPOSED=transposed, WHOLE_BLOCKS=K % NF4_BLOCK == 0,
                                 HARDWARE_E4M3=hardware_e4m3(out.device), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                 BLOCK=NF4_BLOCK, ABSMAX_BLOCK=NF4_ABSMAX_BLOCK, **OPTIONS)
    return out
