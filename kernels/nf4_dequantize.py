"""NF4 dequantization with double-quantized absmax scales, written straight into a given tensor.

References: Dettmers et al. 2023 "QLoRA" (NF4, double quantization); bitsandbytes `functional.py`
(`quantize_4bit`, `dequantize_4bit`, `dequantize_blockwise`) and its CUDA `kDequantizeBlockwise`.

A weight of n values (row-major) is stored as bitsandbytes lays it out (kernels.references.NF4Data):
4-bit codes q, two a byte with the first value in the high nibble; one 8-bit absmax code c_b per block
of 64 values; one fp32 scale s_k per 256 absmax codes; their offset o (fp32); the 256 levels D of the
absmax codes (bitsandbytes' signed dynamic map) and the 16 NF4 levels (NF4_LEVELS). Then

    a_b = D[c_b] · s_{b // 256} + o          block b's absmax, fp32
    W_i = NF4[q_i] · a_{i // 64}             fp32, rounded once to the output dtype

These are bitsandbytes' operations in its order (dequantize_blockwise, += offset, dequantize_4bit),
all in fp32, so the result is bit-equal to `dequantize_4bit`. The kernel is compiled with floating-
point fusion off: a contracted D[c] · s + o (one FMA, one rounding) would differ in the last bit.

One program dequantizes BLOCKS blocks of 64 values: it reads each block's absmax code, scale and level
once, and each packed byte once, and writes each value once, into `out`, which may be the rows of a
larger buffer (the packed [W_q; W_k; W_v] of model/lora.py): no copy follows. `out` may also be the
first K columns of a wider buffer (row stride > K, for K a multiple of 64, so that no block straddles
two rows): the [W | B] of model/lora.py, whose last columns hold the adapters' B.

Reference: kernels.references.nf4_dequantize_reference.
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.references import DTYPES, NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4_LEVELS, NF4Data, check_nf4_args

BLOCKS = 64  # 64-value blocks per program: 4096 values
# Fusion off: a · s + o is rounded twice, as bitsandbytes rounds it (tests/test_kernels_compile.py checks the PTX).
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _nf4_dequantize_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr,
                           out_ptr, n, K, row_stride, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
                           ABSMAX_BLOCK: tl.constexpr, STRIDED: tl.constexpr, HARDWARE_BF16: tl.constexpr):
    HALF: tl.constexpr = BLOCK // 2  # bytes per block
    # The program's first block in int64, every index within the program in int32 relative to it: the per-value
    # index arithmetic is what bounds this kernel, not HBM.
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    lb = tl.arange(0, BLOCKS)  # (BLOCKS,): the program's blocks
    in_range = lb < tl.minimum(tl.cdiv(n, BLOCK) - first, BLOCKS).to(tl.int32)
    c = tl.load(absmax_ptr + first + lb, mask=in_range, other=0).to(tl.int32)
    s = tl.load(absmax_scale_ptr + (first + lb) // ABSMAX_BLOCK, mask=in_range, other=0.0)
    a = tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr)  # (BLOCKS,) fp32

    byte = lb[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (BLOCKS, HALF)
    bytes_left = tl.minimum(n - n // 2 - first * HALF, BLOCKS * HALF).to(tl.int32)
    p = tl.load(packed_ptr + first * HALF + byte, mask=byte < bytes_left, other=0)  # uint8
    high = tl.load(levels_ptr + (p >> 4)) * a[:, None]  # value 2j
    low = tl.load(levels_ptr + (p & 15)) * a[:, None]  # value 2j + 1
    w = tl.reshape(tl.join(high, low), (BLOCKS, BLOCK))  # (BLOCKS, HALF, 2) -> values in order
    i = lb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # the value's index from the program's first
    ok = i < tl.minimum(n - first * BLOCK, BLOCKS * BLOCK).to(tl.int32)
    if STRIDED:  # a block lies in one row (K % BLOCK == 0): rows of row_stride from the first block's row
        KB = K // BLOCK  # blocks a row
        row0 = first // KB
        out_ptr += row0 * row_stride
        b = (first - row0 * KB).to(tl.int32) + lb  # (BLOCKS,): each block's place counted from row0's first
        dest = ((b // KB) * row_stride + (b % KB) * BLOCK)[:, None] + tl.arange(0, BLOCK)[None, :]
    else:
        out_ptr += first * BLOCK
        dest = i
    if out_ptr.dtype.element_ty == tl.bfloat16:
        if HARDWARE_BF16:  # the GPU's conversion rounds to nearest even
            tl.store(out_ptr + dest, w.to(tl.bfloat16), mask=ok)
        else:
            tl.store(out_ptr + dest, _to_bf16(w), mask=ok)
    else:
        tl.store(out_ptr + dest, w.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _to_bf16(x):
    """Finite fp32 x rounded to the nearest bf16, ties to even, by integer arithmetic on its bits: what the GPU's
    conversion gives (HARDWARE_BF16, a single instruction), and what Triton's interpreter (the CPU tests) does not,
    as its cast truncates. It can go when `x.to(tl.bfloat16)` rounds to nearest even in the interpreter
    (tests/test_nf4.py then passes without it)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@lru_cache
def _levels(device):
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def row_strided(out):
    """Whether the kernel writes `out` as the first columns of a wider buffer: a 2-D view of rows of a multiple of
    64 values, each contiguous, spaced further apart than their length."""
    return out.dim() == 2 and out.stride(1) == 1 and out.stride(0) > out.shape[1] and out.shape[1] % NF4_BLOCK == 0


def nf4_dequantize(q: NF4Data, out):
    """Dequantize `q` into `out`, an fp32/bf16/fp16 tensor of the weight's shape, contiguous (e.g. a row slice of
    a larger buffer) or `row_strided` (its first columns), and return `out`."""
    if out.dtype not in DTYPES or not (out.is_contiguous() or row_strided(out)) or out.device != q.packed.device:
        raise ValueError(f"NF4 dequantize: out must be a contiguous (or row-strided, rows of a multiple of "
                         f"{NF4_BLOCK} values) fp32/bf16/fp16 tensor on {q.packed.device}; got {out.dtype}, "
                         f"strides {out.stride()}, on {out.device}")
    n = out.numel()
    check_nf4_args(q, n)
    if n > 0:
        strided = not out.is_contiguous()
        K, row_stride = (out.shape[1], out.stride(0)) if strided else (1, 1)
        grid = (triton.cdiv(triton.cdiv(n, NF4_BLOCK), BLOCKS),)
        _nf4_dequantize_kernel[grid](q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code,
                                     _levels(out.device), out, n, K, row_stride, BLOCKS=BLOCKS, BLOCK=NF4_BLOCK,
                                     ABSMAX_BLOCK=NF4_ABSMAX_BLOCK, STRIDED=strided, HARDWARE_BF16=out.is_cuda,
                                     **OPTIONS)
    return out
