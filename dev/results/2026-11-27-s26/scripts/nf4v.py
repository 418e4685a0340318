"""Session 26: variants of the two NF4 kernels (bf16 dequantize, NF4 -> e4m3) on Llama-3.1-8B's groups; each checked
bit-equal to the current kernel, timed replayed from a CUDA graph."""
import sys, os, itertools
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from kernels.nf4_dequantize import nf4_dequantize, _levels
from kernels.nf4_to_fp8 import nf4_to_fp8, _block_absmax
from kernels.fp8_quantize import e4m3_bits
from kernels.references import NF4Data, E4M3, NF4_BLOCK, NF4_ABSMAX_BLOCK, NF4_LEVELS
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms

dev = torch.device(os.environ.get("DEV", "cuda"))
HWE = dev.type == "cuda"
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
def _pair(pairs_ptr, p):
    t = tl.load(pairs_ptr + p)
    return ((t & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
            (t >> 32).to(tl.uint32).to(tl.float32, bitcast=True))


def pairs_table():
    lv = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=dev).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    i = torch.arange(256, device=dev)
    return lv[i >> 4] | (lv[i & 15] << 32)


@triton.jit
def dq_v1(packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr, levels_ptr, out_ptr, n_blocks,
          K, row_stride, BLOCKS: tl.constexpr, BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr, STRIDED: tl.constexpr,
          HW: tl.constexpr, PAIRS: tl.constexpr = False):
    """out_ptr: int32 words, two bf16 a word (value 2j in the low half)."""
    HALF: tl.constexpr = BLOCK // 2
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    lb = tl.arange(0, BLOCKS)
    ok = lb < n_blocks - first
    c = tl.load(absmax_ptr + first + lb, mask=ok, other=0).to(tl.int32)
    s = tl.load(absmax_scale_ptr + (first + lb) // ABSMAX_BLOCK, mask=ok, other=0.0)
    a = tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr)
    off = lb[:, None] * HALF + tl.arange(0, HALF)[None, :]
    m = ok[:, None]
    p = tl.load(packed_ptr + first * HALF + off, mask=m, other=0)
    if PAIRS:
        hl, ll = _pair(levels_ptr, p)
        high = hl * a[:, None]
        low = ll * a[:, None]
    else:
        high = tl.load(levels_ptr + (p >> 4)) * a[:, None]
        low = tl.load(levels_ptr + (p & 15)) * a[:, None]
    if HW:
        hb = high.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        lbits = low.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        hb = high.to(tl.uint32, bitcast=True)
        hb = (hb + 0x7FFF + ((hb >> 16) & 1)) >> 16
        lbits = low.to(tl.uint32, bitcast=True)
        lbits = (lbits + 0x7FFF + ((lbits >> 16) & 1)) >> 16
    word = (hb | (lbits << 16)).to(tl.int32, bitcast=True)
    if STRIDED:  # a program's blocks may span rows: block b lies in row b*BLOCK // K
        KB = K // BLOCK
        row = (first + lb) // KB
        dest = (row * (row_stride // 2) + ((first + lb) - row * KB) * HALF)[:, None] + tl.arange(0, HALF)[None, :]
        tl.store(out_ptr + dest, word, mask=m)
    else:
        tl.store(out_ptr + first * HALF + off, word, mask=m)


def dequant_v1(q, out, BLOCKS=32, warps=4, hw=True, pairs=False):
    n = out.numel()
    nb = n // 64
    strided = not out.is_contiguous()
    K, rs = (out.shape[1], out.stride(0)) if strided else (1, 1)
    dq_v1[(triton.cdiv(nb, BLOCKS),)](q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code,
                                      PT if pairs else _levels(dev), out.view(torch.int32), nb, K, rs, BLOCKS=BLOCKS,
                                      BLOCK=64, ABSMAX_BLOCK=256, STRIDED=strided, HW=hw, PAIRS=pairs, num_warps=warps,
                                      enable_fp_fusion=False)
    return out


@triton.jit
def f8_v1(weights, rows, first_tiles, levels_ptr, rcp_ptr, out_ptr, out_row_stride, K, first_rows,
          N: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK: tl.constexpr, ABSMAX_BLOCK: tl.constexpr, HWE: tl.constexpr, PAIRS: tl.constexpr,
          JOIN: tl.constexpr):
    """K % BLOCK == 0 only. Row-major: out_ptr int16 words, two e4m3 a word. Transposed: out_ptr uint8."""
    tile = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    NB: tl.constexpr = BLOCK_K // BLOCK
    HALF: tl.constexpr = BLOCK // 2
    for j in tl.static_range(N):
        if (tile >= first_tiles[j]) & (tile < first_tiles[j + 1]):
            packed_ptr, absmax_ptr, absmax_scale_ptr, absmax_offset_ptr, absmax_code_ptr = weights[j]
            r0 = (tile - first_tiles[j]) * BLOCK_R
            lr = tl.arange(0, BLOCK_R)
            row_ok = lr < rows[j] - r0
            KB = K // BLOCK
            b0 = r0.to(tl.int64) * KB + k0 // BLOCK  # first block of the tile
            lblock = lr[:, None] * KB + tl.arange(0, NB)[None, :]  # (BLOCK_R, NB) int32
            bok = row_ok[:, None] & (k0 + tl.arange(0, NB)[None, :] * BLOCK < K)
            c = tl.load(absmax_ptr + b0 + lblock, mask=bok, other=0).to(tl.int32)
            s = tl.load(absmax_scale_ptr + (b0 + lblock) // ABSMAX_BLOCK, mask=bok, other=0.0)
            a = (tl.load(absmax_code_ptr + c) * s + tl.load(absmax_offset_ptr))[:, :, None]
            lbyte = lblock[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]
            p = tl.load(packed_ptr + b0 * HALF + lbyte, mask=bok[:, :, None], other=0)
            if PAIRS:
                hl, ll = _pair(levels_ptr, p)
                high = hl * a
                low = ll * a
            else:
                high = tl.load(levels_ptr + (p >> 4)) * a
                low = tl.load(levels_ptr + (p & 15)) * a
            g0 = first_rows[j] + r0
            if TRANSPOSED:
                w = tl.reshape(tl.join(high, low), (BLOCK_R, BLOCK_K))
                k = k0 + tl.arange(0, BLOCK_K)
                q = e4m3_bits(w * tl.load(rcp_ptr + k)[None, :], HWE)
                dest = tl.arange(0, BLOCK_K)[:, None] * out_row_stride + lr[None, :]
                tl.store(out_ptr + (k0.to(tl.int64) * out_row_stride + g0) + dest, tl.trans(q),
                         mask=tl.trans(row_ok[:, None] & (k[None, :] < K)))
            elif JOIN:
                w = tl.reshape(tl.join(high, low), (BLOCK_R, BLOCK_K))
                k = k0 + tl.arange(0, BLOCK_K)
                rc = tl.load(rcp_ptr + g0 + lr, mask=row_ok, other=1.0)[:, None]
                q = e4m3_bits(w * rc, HWE)
                dest = lr[:, None] * out_row_stride + tl.arange(0, BLOCK_K)[None, :]
                tl.store(out_ptr + (g0.to(tl.int64) * out_row_stride + k0) + dest, q,
                         mask=row_ok[:, None] & (k[None, :] < K))
            else:
                rc = tl.load(rcp_ptr + g0 + lr, mask=row_ok, other=1.0)[:, None, None]
                qh = e4m3_bits(high * rc, HWE).to(tl.uint16)
                ql = e4m3_bits(low * rc, HWE).to(tl.uint16)
                word = (qh | (ql << 8)).to(tl.int16, bitcast=True)  # (BLOCK_R, NB, HALF)
                dest = (lr[:, None, None] * (out_row_stride // 2) + tl.arange(0, NB)[None, :, None] * HALF
                        + tl.arange(0, HALF)[None, None, :])
                tl.store(out_ptr + (g0.to(tl.int64) * (out_row_stride // 2) + k0 // 2) + dest, word,
                         mask=bok[:, :, None])


def to_fp8_v1(weights, rcp, out, transposed, BR=64, BK=128, warps=8, pairs=False, join=False, hwe=None):
    rows = [R for _, (R, _) in weights]
    K = weights[0][1][1]
    tiles = [0]
    for R in rows:
        tiles.append(tiles[-1] + triton.cdiv(R, BR))
    first_rows = [sum(rows[:j]) for j in range(len(rows))]
    f8_v1[(tiles[-1], triton.cdiv(K, BK))](tuple(tuple(q) for q, _ in weights), tuple(rows), tuple(tiles),
                                          PT if pairs else _levels(dev),
                                          rcp, out.view(torch.uint8) if (transposed or join) else out.view(torch.int16),
                                          out.stride(0), K, tuple(first_rows), N=len(weights), TRANSPOSED=transposed,
                                          BLOCK_R=BR, BLOCK_K=BK, BLOCK=64, ABSMAX_BLOCK=256, HWE=HWE if hwe is None else hwe,
                                          PAIRS=pairs, JOIN=join, num_warps=warps,
                                          enable_fp_fusion=False)
    return out


def timed(fn):
    if dev.type != "cuda":
        return 1.0
    return median_ms(replayed(fn), "cuda")


H, I, KV = (4096, 14336, 1024) if dev.type == "cuda" else (256, 384, 64)
GROUPS = {"q|k|v": [(H, H), (KV, H), (KV, H)], "o": [(H, H)], "gate|up": [(I, H), (I, H)], "down": [(H, I)]}
PT = pairs_table()
print(torch.cuda.get_device_name() if HWE else "cpu", triton.__version__, flush=True)
for name, shapes in GROUPS.items():
    qs = [rand_nf4(*s) for s in shapes]
    total, K = sum(s[0] for s in shapes), shapes[0][1]
    nbytes_in = sum(q.packed.numel() + q.absmax.numel() for q in qs)
    # bf16 dequantize into rows of one buffer
    buf = torch.empty(total, K, dtype=torch.bfloat16, device=dev)
    rows = [0] + list(itertools.accumulate(s[0] for s in shapes))

    def cur():
        for q, a, b in zip(qs, rows, rows[1:]):
            nf4_dequantize(q, buf[a:b])
    cur(); ref = buf.clone()
    moved = nbytes_in + buf.numel() * 2
    t = timed(cur)
    print(f"{name} bf16 current: {t * 1e3:.1f} us, {moved / t / 1e6:.0f} GB/s", flush=True)
    for BLOCKS, warps, hw, pr in [(64, 4, HWE, False), (64, 4, HWE, True), (128, 8, HWE, True), (128, 4, HWE, True),
                                  (32, 4, HWE, True), (64, 2, HWE, True)]:
        def v1():
            for q, a, b in zip(qs, rows, rows[1:]):
                dequant_v1(q, buf[a:b], BLOCKS, warps, hw, pr)
        buf.zero_(); v1()
        eq = torch.equal(buf.view(torch.int16), ref.view(torch.int16))
        t = timed(v1)
        print(f"  v1 BLOCKS={BLOCKS} warps={warps} hw={hw} pairs={pr}: {t * 1e3:.1f} us, {moved / t / 1e6:.0f} GB/s, equal {eq}",
              flush=True)
    # bf16 into [W | B] (row-strided)
    wide = torch.empty(total, K + 16, dtype=torch.bfloat16, device=dev)
    if len(qs) == 1:
        view = wide[:, :K]
        nf4_dequantize(qs[0], view); r2 = view.clone(); wide.zero_()
        dequant_v1(qs[0], view, hw=HWE)
        print(f"  v1 strided equal {torch.equal(view.view(torch.int16), r2.view(torch.int16))}", flush=True)
    del buf, wide
    # fp8
    group = [(q, s) for q, s in zip(qs, shapes)]
    for transposed in (False, True):
        out = torch.empty((K, total) if transposed else (total, K), dtype=E4M3, device=dev)
        rcp = 1.0 / (torch.rand(K if transposed else total, device=dev, generator=g) * 0.05 + 0.01)
        nf4_to_fp8(group, rcp, out, transposed); ref = out.view(torch.uint8).clone()
        moved = nbytes_in + out.numel()
        t = timed(lambda: nf4_to_fp8(group, rcp, out, transposed))
        print(f"{name} fp8 {'Wt' if transposed else 'W '} current: {t * 1e3:.1f} us, {moved / t / 1e6:.0f} GB/s",
              flush=True)
        for BR, BK, warps, pr, jn, hwe in [(128, 64, 4, False, False, None), (128, 64, 4, False, False, False),
                                           (128, 64, 4, False, True, None), (128, 64, 4, True, False, None),
                                           (128, 64, 4, True, True, None), (64, 64, 4, True, True, None),
                                           (256, 64, 4, True, True, None), (128, 64, 8, True, True, None),
                                           (64, 128, 4, True, True, None)]:
            out.view(torch.uint8).zero_()
            to_fp8_v1(group, rcp, out, transposed, BR, BK, warps, pr, jn, hwe)
            eq = torch.equal(out.view(torch.uint8), ref)
            bad = (out.view(torch.uint8) != ref).sum().item()
            t = timed(lambda: to_fp8_v1(group, rcp, out, transposed, BR, BK, warps, pr, jn, hwe))
            print(f"  v1 {BR}x{BK} warps={warps} pairs={pr} join={jn} hwe={hwe}: {t * 1e3:.1f} us, "
                  f"{moved / t / 1e6:.0f} GB/s, equal {eq} ({bad} bytes differ)", flush=True)
        del out
