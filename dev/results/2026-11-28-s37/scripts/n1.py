"""Session 37: NF4 -> e4m3 on Llama-3.1-8B's shapes: the kernel, its ablations (no level gather, no e4m3 conversion,
no transpose), a copy at the same bytes, and a row-wise variant that converts a block's 16 levels once and looks the
values' bytes up with prmt (checked bit-equal to the kernel). Graph replays, median of do_bench."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kernels.nf4_to_fp8 import nf4_to_fp8, _block_absmax, _levels
from kernels.fp8_quantize import e4m3_bits
from kernels.references import NF4Data, E4M3, fp8_reciprocal
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)


def rand_nf4(R, K):
    n = R * K
    nb = n // 64
    code = torch.sort(torch.rand(256, device=dev, generator=g) * 2 - 1).values
    return NF4Data(torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=dev, generator=g),
                   torch.randint(0, 256, (nb,), dtype=torch.uint8, device=dev, generator=g),
                   torch.rand(-(-nb // 256), device=dev, generator=g) * 0.05 + 0.01,
                   torch.tensor(0.02, device=dev), code)


@triton.jit
def abl_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, rcp_ptr,
               out_ptr, out_row_stride, R, K, TRANSPOSED: tl.constexpr, GATHER: tl.constexpr, CVT: tl.constexpr,
               TRANS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    BLOCK: tl.constexpr = 64
    NB: tl.constexpr = BLOCK_K // BLOCK
    HALF: tl.constexpr = BLOCK // 2
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


PRMT = """{
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
}"""


@triton.jit
def _lookup(t0, t1, t2, t3, sel):
    return tl.inline_asm_elementwise(PRMT, "=r,r,r,r,r,r", [t0, t1, t2, t3, sel], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def table_kernel(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, rcp_ptr,
                 out_ptr, out_row_stride, R, K, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """row-wise: out[r, k] = e4m3(W_rk / scale_r); packed_ptr, out_ptr as int32 words. A program: BLOCK_R rows x NB
    blocks of 64. Each (row, block) converts its 16 levels once (the same products as the kernel), then each value's
    byte is looked up by its nibble."""
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


def report(name, fn, nbytes):
    ms = median_ms(replayed(fn), dev)
    print(f"  {name:44s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:6.2f} TB/s", flush=True)
    return ms


for name, (R, K) in {"gate|up": (28672, 4096), "down": (4096, 14336), "q|k|v": (6144, 4096)}.items():
    q = rand_nf4(R, K)
    nbytes = R * K * 1.5
    scale_r = torch.rand(R, device=dev, generator=g) * 0.01 + 0.001
    scale_k = torch.rand(K, device=dev, generator=g) * 0.01 + 0.001
    rcp_r, rcp_k = fp8_reciprocal(scale_r), fp8_reciprocal(scale_k)
    out = torch.empty(R, K, dtype=E4M3, device=dev)
    outT = torch.empty(K, R, dtype=E4M3, device=dev)
    print(f"== {name} {R} x {K}", flush=True)
    report("kernel W", lambda: nf4_to_fp8([(q, (R, K))], rcp_r, out), nbytes)
    ref = out.view(torch.uint8).clone()
    report("kernel W^T", lambda: nf4_to_fp8([(q, (R, K))], rcp_k, outT, transposed=True), nbytes)
    refT = outT.view(torch.uint8).clone()
    buf = torch.empty(R * K, dtype=torch.uint8, device=dev)
    report("copy 0.5 B in, 1 B out", lambda: copy_kernel[(triton.cdiv(R * K // 2, 4096),)](q.packed, buf, R * K // 2,
                                                                                           BLOCK=4096), nbytes)
    args = (q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code, _levels(dev))
    for transposed in (False, True):
        for gather, cvt, trans in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0)):
            if not transposed and not trans:
                continue
            o = (outT if transposed else out).view(torch.uint8)
            fn = lambda: abl_kernel[(triton.cdiv(R, 128), triton.cdiv(K, 64))](
                *args, rcp_k if transposed else rcp_r, o, o.stride(0), R, K, TRANSPOSED=transposed, GATHER=gather,
                CVT=cvt, TRANS=trans, BLOCK_R=128, BLOCK_K=64, num_warps=4, enable_fp_fusion=False)
            report(f"abl {'W^T' if transposed else 'W'} gather={gather} cvt={cvt} trans={trans}", fn, nbytes)
            if gather and cvt and trans:
                assert torch.equal(o, refT if transposed else ref), "ablation copy differs"
    for BR, NB, warps in ((64, 1, 4), (128, 1, 4), (32, 2, 4), (64, 2, 4), (64, 4, 4), (128, 2, 8), (32, 4, 4),
                          (16, 4, 2), (32, 8, 4)):
        out.view(torch.uint8).zero_()
        fn = lambda: table_kernel[(triton.cdiv(R, BR), triton.cdiv(K // 64, NB))](
            q.packed.view(torch.int32), *args[1:], rcp_r, out.view(torch.int32), K, R, K, BLOCK_R=BR, NB=NB, num_warps=warps, enable_fp_fusion=False)
        try:
            report(f"table W BR={BR} NB={NB} warps={warps}", fn, nbytes)
            print(f"    equal: {torch.equal(out.view(torch.uint8), ref)}", flush=True)
        except Exception as exc:
            print(f"    failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
