"""Session 37: kernels for n2.py (NF4 -> e4m3 variants)."""
import os, sys
sys.path.insert(0, os.getcwd())
import triton, triton.language as tl
from kernels.nf4_to_fp8 import _block_absmax
from kernels.fp8_quantize import e4m3_bits


@triton.jit
def abl_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, rcp_ptr,
               out_ptr, out_row_stride, R, K, TRANSPOSED: tl.constexpr, GATHER: tl.constexpr, CVT: tl.constexpr,
               TRANS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr = False):
    BLOCK: tl.constexpr = 64
    NB: tl.constexpr = BLOCK_K // BLOCK
    HALF: tl.constexpr = BLOCK // 2
    if K_FIRST:
        r0 = tl.program_id(1).to(tl.int64) * BLOCK_R
        k0 = tl.program_id(0) * BLOCK_K
    else:
        r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
        k0 = tl.program_id(1) * BLOCK_K
    r = tl.arange(0, BLOCK_R)
    row_ok = r < (R - r0).to(tl.int32)
    k = k0 + tl.arange(0, BLOCK_K)
    first = (r0 * K + k0) // BLOCK
    block = r[:, None] * (K // BLOCK) + tl.arange(0, NB)[None, :]
    block_ok = row_ok[:, None] & (k0 + tl.arange(0, NB)[None, :] * BLOCK < K)
    a = _block_absmax(first + block, block_ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr,
                      256)[:, :, None]
    byte = block[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]
    p = tl.load(packed_ptr + first * HALF + byte, mask=block_ok[:, :, None], other=0)
    if GATHER:
        high = tl.load(levels_ptr + (p >> 4)) * a
        low = tl.load(levels_ptr + (p & 15)) * a
    else:
        high = (p >> 4).to(tl.float32) * a
        low = (p & 15).to(tl.float32) * a
    w = tl.reshape(tl.join(high, low), (BLOCK_R, BLOCK_K))
    ok = row_ok[:, None] & (k[None, :] < K)
    if TRANSPOSED:
        x = w * tl.load(rcp_ptr + k, mask=k < K, other=1.0)[None, :]
        if CVT:
            q = e4m3_bits(x, True)
        else:
            q = (x.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
        if TRANS:
            dest = tl.arange(0, BLOCK_K)[:, None] * out_row_stride + r[None, :]
            tl.store(out_ptr + (k0.to(tl.int64) * out_row_stride + r0) + dest, tl.trans(q), mask=tl.trans(ok))
        else:
            dest = r[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            tl.store(out_ptr + (k0.to(tl.int64) * out_row_stride + r0 * BLOCK_K) + dest, q, mask=ok)
    else:
        x = w * tl.load(rcp_ptr + r0 + r, mask=row_ok, other=1.0)[:, None]
        if CVT:
            q = e4m3_bits(x, True)
        else:
            q = (x.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
        dest = r[:, None] * out_row_stride + tl.arange(0, BLOCK_K)[None, :]
        tl.store(out_ptr + (r0 * out_row_stride + k0) + dest, q, mask=ok)


@triton.jit
def copy_kernel(packed_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """reads n bytes, writes 2n: the conversion's bytes."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(packed_ptr + i, mask=i < n, other=0)
    q = tl.reshape(tl.join(p, p + 1), (2 * BLOCK,))
    tl.store(out_ptr + 2 * tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK), q,
             mask=2 * tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK) < 2 * n)


PRMT = tl.constexpr("""{
.reg .b32 s7, lo, hi, s1, m, x;
and.b32 s7, $5, 0x7777;
prmt.b32 lo, $1, $2, s7;
prmt.b32 hi, $3, $4, s7;
shr.b32 s1, $5, 3;
and.b32 s1, s1, 0x1111;
mov.b32 x, 0xFF00;
prmt.b32 m, x, x, s1;
xor.b32 x, lo, hi;
and.b32 x, x, m;
xor.b32 $0, lo, x;
}""")


@triton.jit
def _lookup(t0, t1, t2, t3, sel):
    return tl.inline_asm_elementwise(PRMT, "=r,r,r,r,r,r", [t0, t1, t2, t3, sel], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def table_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, rcp_ptr,
                 out_ptr, out_row_stride, R, K, BLOCK_R: tl.constexpr, NB: tl.constexpr, K_FIRST: tl.constexpr = False):
    """row-wise: out[r, k] = e4m3(W_rk / scale_r); packed_ptr, out_ptr as int32 words. A program: BLOCK_R rows x NB
    blocks of 64. Each (row, block) converts its 16 levels once (the same products as the kernel), then each value's
    byte is looked up by its nibble."""
    if K_FIRST:
        r0 = tl.program_id(1).to(tl.int64) * BLOCK_R
        kb0 = tl.program_id(0) * NB
    else:
        r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
        kb0 = tl.program_id(1) * NB
    r = tl.arange(0, BLOCK_R)
    row_ok = r < (R - r0).to(tl.int32)
    KB = K // 64
    first = r0 * KB + kb0
    block = r[:, None] * KB + tl.arange(0, NB)[None, :]  # (BLOCK_R, NB)
    block_ok = row_ok[:, None] & (kb0 + tl.arange(0, NB)[None, :] < KB)
    a = _block_absmax(first + block, block_ok, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, 256)
    rcp = tl.load(rcp_ptr + r0 + r, mask=row_ok, other=1.0)
    lv = tl.load(levels_ptr + tl.arange(0, 16))
    t = e4m3_bits((lv[None, None, :] * a[:, :, None]) * rcp[:, None, None], True).to(tl.uint32)  # (BLOCK_R, NB, 16)
    t = tl.reshape(t, (BLOCK_R, NB, 4, 4))
    words = tl.sum(t << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, None, :], axis=3)  # (BLOCK_R, NB, 4)
    e, o = tl.split(tl.reshape(words, (BLOCK_R, NB, 2, 2)))  # words 0, 2 and 1, 3
    t0, t2 = tl.split(e)
    t1, t3 = tl.split(o)
    wi = block[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # (BLOCK_R, NB, 8) words of packed
    p = tl.load(packed_ptr + first * 8 + wi, mask=block_ok[:, :, None], other=0).to(tl.uint32, bitcast=True)
    s = ((p >> 4) & 0x0F0F0F0F) | ((p & 0x0F0F0F0F) << 4)  # nibbles in value order
    t0, t1, t2, t3 = t0[:, :, None], t1[:, :, None], t2[:, :, None], t3[:, :, None]
    o0 = _lookup(t0, t1, t2, t3, s & 0xFFFF)
    o1 = _lookup(t0, t1, t2, t3, s >> 16)
    q = tl.reshape(tl.join(o0, o1), (BLOCK_R, NB * 16)).to(tl.int32, bitcast=True)
    dest = r[:, None] * (out_row_stride // 4) + tl.arange(0, NB * 16)[None, :]
    ok = row_ok[:, None] & (kb0 * 16 + tl.arange(0, NB * 16)[None, :] < K // 4)
    tl.store(out_ptr + (r0 * (out_row_stride // 4) + kb0 * 16) + dest, q, mask=ok)


