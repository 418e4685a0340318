"""NF4 weights (double-quantized absmax) straight to FP8 (e4m3) with given scales, row-major or transposed.

References: kernels/nf4_dequantize.py (the NF4 format and its dequantization, bit-equal to bitsandbytes'
`dequantize_4bit`); kernels/fp8_quantize.py (e4m3, and its rounding).

A weight W [R, K] stored as NF4 (kernels.references.NF4Data) has values, in fp32,

    W_rk = NF4[q_i] · a_{i // 64},   a_b = D[c_b] · s_{b // 256} + o,   i = r K + k

computed as nf4_dequantize computes them (no fused multiply-add, so W_rk is bitsandbytes' fp32 value). This
kernel writes them as e4m3 without a bf16 copy in between:

    row-wise:    out[r, k] = e4m3(W_rk / scale_r)     scale (R,): W's rows, the forward GEMM's operand X Wᵀ
    transposed:  out[k, r] = e4m3(W_rk / scale_k)     scale (K,): Wᵀ's rows, the input gradient's dY W

`out` may be the rows [r0, r0 + R) of a larger [Σout, K] buffer, or, transposed, the columns [r0, r0 + R) of a
larger [K, Σout] one (the packed q, k, v of model/lora.py): its strides are arguments. One program converts a
BLOCK_R × BLOCK_K tile of W; its block scales, packed bytes and levels are gathered per value (they repeat
within the tile, so the loads hit the cache). The transposed store is a tile too, so that its writes coalesce.

Reference: kernels.references.nf4_to_fp8_reference.
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.fp8_quantize import to_e4m3_bits
from kernels.references import E4M3, NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4_LEVELS, NF4Data, check_nf4_args

BLOCK_R, BLOCK_K = 32, 64
# Fusion off: a · s + o is rounded twice, as bitsandbytes rounds it (kernels/nf4_dequantize.py).
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _nf4_to_fp8_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr,
                       scale_ptr, out_ptr, out_row_stride, out_col_stride, R, K, TRANSPOSED: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    ok = (r[:, None] < R) & (k[None, :] < K)
    i = r[:, None] * K + k[None, :]  # (BLOCK_R, BLOCK_K): flat index into W
    block = i // BLOCK
    c = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
    s = tl.load(absmax_scale_ptr + block // ABSMAX_BLOCK, mask=ok, other=0.0)
    a = tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr)  # fp32, each value's block absmax
    p = tl.load(packed_ptr + i // 2, mask=ok, other=0)  # uint8: value 2j in the high nibble, 2j + 1 in the low
    code = tl.where(i % 2 == 0, p >> 4, p & 15)
    w = tl.load(levels_ptr + code) * a
    if TRANSPOSED:
        scale = tl.load(scale_ptr + k, mask=k < K, other=1.0)[None, :]
    else:
        scale = tl.load(scale_ptr + r, mask=r < R, other=1.0)[:, None]
    q = to_e4m3_bits(tl.div_rn(w, scale))
    tl.store(out_ptr + r[:, None] * out_row_stride + k[None, :] * out_col_stride, q, mask=ok)


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
        # W[r, k] goes to out[k, r] when transposed: its strides, swapped, are the store's.
        row_stride, col_stride = (1, out.stride(0)) if transposed else (out.stride(0), 1)
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(K, BLOCK_K))
        _nf4_to_fp8_kernel[grid](q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code,
                                 _levels(out.device), scale.contiguous(), out.view(torch.uint8), row_stride,
                                 col_stride, R, K, TRANSPOSED=transposed, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                 BLOCK=NF4_BLOCK, ABSMAX_BLOCK=NF4_ABSMAX_BLOCK, **OPTIONS)
    return out
