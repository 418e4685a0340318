"""NF4 weights (double-quantized absmax) straight to FP8 (e4m3) with given scales, row-major or transposed: the
weights of a group of projections that share an input (q, k, v; gate, up) into one buffer, in one launch.

References: kernels/nf4_dequantize.py (the NF4 format and its dequantization, bit-equal to bitsandbytes'
`dequantize_4bit`); kernels/fp8_quantize.py (e4m3, and its rounding).

A weight W [R, K] stored as NF4 (kernels.references.NF4Data) has values, in fp32,

    W_rk = NF4[q_i] · a_{i // 64},   a_b = D[c_b] · s_{b // 256} + o,   i = r K + k

computed as nf4_dequantize computes them (no fused multiply-add, so W_rk is bitsandbytes' fp32 value). This
kernel writes the group [W_1; W_2; ...] [Σout, K] as e4m3 without a bf16 copy in between, with one fp32 scale
per row of what it writes:

    row-wise:    out[g, k] = e4m3(W_gk · (1 / scale_g))     scale (Σout,): the forward GEMM's operand X Wᵀ
    transposed:  out[k, g] = e4m3(W_gk · (1 / scale_k))     scale (K,): Wᵀ's rows, the input gradient's dY W

where g is a row of the group (row r of projection j is g = r + R_1 + ... + R_{j-1}). The launcher takes the
reciprocals 1 / scale (kernels.references.fp8_reciprocal), which model/fp8.py computes once at load: a product
by them is the reference's, and a thread holds values of many rows or columns. e4m3 comes from
kernels/fp8_quantize.py's `e4m3_bits` (the GPU's conversion on sm_89+, else the fp32 bits).

One launch covers the group: each projection keeps its own NF4 tensors (a tuple of pointers per argument), and the
grid's second axis runs over the row tiles of every projection in turn, so that a tile never spans two projections;
the program picks its projection by its tile index. The first axis runs along K, so that programs launched one after
another convert neighbouring tiles of the same rows and read and write neighbouring bytes (the faster order on an
H100: dev/perf-notes.md). One program converts a BLOCK_R × BLOCK_K tile of W. Where K is a multiple of 64 (every
real model), each tile row holds whole 64-value blocks: the program reads each block's absmax once and each packed
byte once (both nibbles, joined), as kernels/nf4_dequantize.py does. Otherwise blocks and bytes may straddle rows,
and each value gathers its own. The transposed tile is transposed in registers (`tl.trans`), so that its store runs
along out's contiguous dimension too: BLOCK_R bytes a row of out, whole 32-byte sectors.

`out` may be a slice of a larger buffer whose last dimension is contiguous: its row stride is an argument.

Reference: kernels.references.nf4_to_fp8_reference, per projection.
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.fp8_quantize import e4m3_bits, hardware_e4m3
from kernels.references import E4M3, NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4_LEVELS, check_nf4_args

BLOCK_R, BLOCK_K = 128, 64  # a tile: 128 contiguous bytes of out a row when transposed, 64 when not
# Fusion off: a · s + o is rounded twice, as bitsandbytes rounds it (kernels/nf4_dequantize.py).
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _block_absmax(block, mask, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                  ABSMAX_BLOCK: tl.constexpr):
    """a_b = D[c_b] · s_{b // 256} + o, fp32, for the block indices `block`."""
    c = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
    s = tl.load(absmax_scale_ptr + block // ABSMAX_BLOCK, mask=mask, other=0.0)
    return tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr)


@triton.jit
def _nf4_tile(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, r0, k0, rows,
              row_ok, K, WHOLE_BLOCKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr):
    """W[r0:r0 + BLOCK_R, k0:k0 + BLOCK_K] (BLOCK_R, BLOCK_K) fp32 of one NF4 weight W [R, K] (zeros outside W):
    `rows` (BLOCK_R,) int32 the tile's rows counted from r0, `row_ok` which of them are W's."""
    if WHOLE_BLOCKS:  # K % BLOCK == 0 and BLOCK_K % BLOCK == 0: a tile row is BLOCK_K // BLOCK whole blocks
        NB: tl.constexpr = BLOCK_K // BLOCK
        HALF: tl.constexpr = BLOCK // 2  # bytes a block
        # The tile's first block in int64, the rest in int32 relative to it: the per-value index arithmetic is
        # what bounds this kernel, not HBM.
        first = (r0 * K + k0) // BLOCK
        block = rows[:, None] * (K // BLOCK) + tl.arange(0, NB)[None, :]  # (BLOCK_R, NB)
        block_ok = row_ok[:, None] & (k0 + tl.arange(0, NB)[None, :] * BLOCK < K)
        a = _block_absmax(first + block, block_ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                          ABSMAX_BLOCK)[:, :, None]  # (BLOCK_R, NB, 1)
        byte = block[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # (BLOCK_R, NB, HALF)
        p = tl.load(packed_ptr + first * HALF + byte, mask=block_ok[:, :, None], other=0)  # uint8
        high = tl.load(levels_ptr + (p >> 4)) * a  # value 2j
        low = tl.load(levels_ptr + (p & 15)) * a  # value 2j + 1
        return tl.reshape(tl.join(high, low), (BLOCK_R, BLOCK_K))  # (BLOCK_R, NB, HALF, 2) -> values in order
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (k[None, :] < K)
        i = (r0 + rows)[:, None] * K + k[None, :]  # (BLOCK_R, BLOCK_K): flat index into W
        a = _block_absmax(i // BLOCK, ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                          ABSMAX_BLOCK)
        p = tl.load(packed_ptr + i // 2, mask=ok, other=0)  # uint8: value 2j in the high nibble, 2j + 1 in the low
        return tl.load(levels_ptr + tl.where(i % 2 == 0, p >> 4, p & 15)) * a


@triton.jit
def _nf4_to_fp8_kernel(weights, rows, first_rows, first_tiles, levels_ptr, rcp_ptr, out_ptr, out_row_stride, K,
                       N: tl.constexpr, TRANSPOSED: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
                       HARDWARE_E4M3: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr):
    """weights: N tuples (packed, absmax, absmax_scale, absmax_offset, absmax_code), one a projection; rows: their
    R_j; first_rows: the group's row where each starts; first_tiles: the row tile where each starts, and the end."""
    tile = tl.program_id(1)
    k0 = tl.program_id(0) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    for j in tl.static_range(N):  # the one projection whose rows this tile holds
        if (tile >= first_tiles[j]) & (tile < first_tiles[j + 1]):
            packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr = weights[j]
            r0 = (tile - first_tiles[j]).to(tl.int64) * BLOCK_R  # the tile's first row of W_j
            r = tl.arange(0, BLOCK_R)  # (BLOCK_R,): its rows, from r0
            row_ok = r < (rows[j] - r0).to(tl.int32)
            w = _nf4_tile(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr,
                          r0, k0, r, row_ok, K, WHOLE_BLOCKS, BLOCK_R, BLOCK_K, BLOCK, ABSMAX_BLOCK)
            ok = row_ok[:, None] & (k[None, :] < K)
            g0 = first_rows[j] + r0  # the group's row of r0
            if TRANSPOSED:
                q = e4m3_bits(w * tl.load(rcp_ptr + k, mask=k < K, other=1.0)[None, :], HARDWARE_E4M3)
                dest = tl.arange(0, BLOCK_K)[:, None] * out_row_stride + r[None, :]
                tl.store(out_ptr + (k0.to(tl.int64) * out_row_stride + g0) + dest, tl.trans(q), mask=tl.trans(ok))
            else:
                q = e4m3_bits(w * tl.load(rcp_ptr + g0 + r, mask=row_ok, other=1.0)[:, None], HARDWARE_E4M3)
                dest = r[:, None] * out_row_stride + tl.arange(0, BLOCK_K)[None, :]
                tl.store(out_ptr + (g0 * out_row_stride + k0) + dest, q, mask=ok)


@lru_cache
def _levels(device):
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def nf4_to_fp8(weights, reciprocal, out, transposed=False):
    """The group [W_1; W_2; ...] [Σout, K] of `weights`, a list of (NF4Data, (R_j, K)), into `out` as e4m3 with
    the reciprocals of its fp32 scales (kernels.references.fp8_reciprocal): out [Σout, K] and reciprocal
    (Σout,) per row, or transposed, out [K, Σout] and reciprocal (K,) per row of Wᵀ. out may be a slice of a
    larger buffer whose last dimension is contiguous. One launch. Returns `out`."""
    if not weights or len({K for _, (_, K) in weights}) != 1:
        raise ValueError(f"NF4 to fp8: weights must be one or more (NF4Data, (R, K)) of one K, got shapes "
                         f"{[tuple(shape) for _, shape in weights]}")
    rows = [R for _, (R, _) in weights]
    total, K, device = sum(rows), weights[0][1][1], weights[0][0].packed.device
    expected = (K, total) if transposed else (total, K)
    if out.dtype != E4M3 or tuple(out.shape) != expected or out.stride(1) != 1 or out.device != device:
        raise ValueError(f"NF4 to fp8: out must be {expected} e4m3 with a contiguous last dimension on {device}; "
                         f"got {tuple(out.shape)} {out.dtype}, strides {out.stride()}, on {out.device}")
    n = K if transposed else total
    if reciprocal.dtype != torch.float32 or reciprocal.shape != (n,) or reciprocal.device != device:
        raise ValueError(f"NF4 to fp8: reciprocal must be ({n},) fp32 on {device}, got {tuple(reciprocal.shape)} "
                         f"{reciprocal.dtype} on {reciprocal.device}")
    for q, (R, _) in weights:
        check_nf4_args(q, R * K)
    if total * K == 0:
        return out
    tiles = [0]
    for R in rows:
        tiles.append(tiles[-1] + triton.cdiv(R, BLOCK_R))
    first_rows = [sum(rows[:j]) for j in range(len(rows))]
    grid = (triton.cdiv(K, BLOCK_K), tiles[-1])
    _nf4_to_fp8_kernel[grid](tuple(tuple(q) for q, _ in weights), tuple(rows), tuple(first_rows), tuple(tiles),
                             _levels(device), reciprocal, out.view(torch.uint8), out.stride(0), K, N=len(weights),
                             TRANSPOSED=transposed, WHOLE_BLOCKS=K % NF4_BLOCK == 0,
                             HARDWARE_E4M3=hardware_e4m3(device), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BLOCK=NF4_BLOCK,
                             ABSMAX_BLOCK=NF4_ABSMAX_BLOCK, **OPTIONS)
    return out
