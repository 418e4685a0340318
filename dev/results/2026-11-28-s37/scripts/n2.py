"""Session 37 call 2: NF4 -> e4m3 on Llama-3.1-8B's shapes: the kernel; exact copies of its logic with the grid's
order along K first and other tiles; the row-wise table variant (a block's 16 levels converted once, each value's
byte looked up with prmt). Every variant checked bit-equal to the kernel. Graph replays, median of do_bench."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
import torch, triton
from kernels.nf4_to_fp8 import nf4_to_fp8, _levels
from kernels.references import NF4Data, E4M3, fp8_reciprocal
from scripts.bench.bench_nf4 import replayed
from scripts.bench.harness import median_ms
from nk import abl_kernel, table_kernel, copy_kernel

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


def report(name, fn, nbytes, out=None, ref=None):
    try:
        ms = median_ms(replayed(fn), dev)
    except Exception as exc:
        print(f"  {name:52s} failed: {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
        return
    eq = "" if ref is None else ("  equal" if torch.equal(out, ref) else "  DIFFERS")
    print(f"  {name:52s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:6.2f} TB/s{eq}", flush=True)


for name, (R, K) in {"gate|up": (28672, 4096), "down": (4096, 14336), "q|k|v": (6144, 4096), "o": (4096, 4096)}.items():
    q = rand_nf4(R, K)
    nbytes = R * K * 1.5
    rcp_r = fp8_reciprocal(torch.rand(R, device=dev, generator=g) * 0.01 + 0.001)
    rcp_k = fp8_reciprocal(torch.rand(K, device=dev, generator=g) * 0.01 + 0.001)
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
    for transposed, tiles in ((False, ((128, 64, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (16, 256, 2))),
                              (True, ((128, 64, 4), (128, 128, 8), (64, 128, 4), (128, 256, 8), (64, 256, 8)))):
        o = (outT if transposed else out).view(torch.uint8)
        for BR, BK, warps in tiles:
            for kf in (False, True):
                grid = (triton.cdiv(K, BK), triton.cdiv(R, BR)) if kf else (triton.cdiv(R, BR), triton.cdiv(K, BK))
                o.zero_()
                fn = lambda: abl_kernel[grid](*args, rcp_k if transposed else rcp_r, o, o.stride(0), R, K,
                                              TRANSPOSED=transposed, GATHER=True, CVT=True, TRANS=True, BLOCK_R=BR,
                                              BLOCK_K=BK, K_FIRST=kf, num_warps=warps, enable_fp_fusion=False)
                report(f"{'W^T' if transposed else 'W'} tile {BR}x{BK} w{warps} k_first={int(kf)}", fn, nbytes, o,
                       refT if transposed else ref)
    for BR, NB, warps in ((128, 1, 4), (64, 2, 4), (32, 4, 4), (64, 4, 4), (16, 8, 4), (32, 8, 4), (64, 4, 8)):
        for kf in (False, True):
            grid = (triton.cdiv(K // 64, NB), triton.cdiv(R, BR)) if kf else (triton.cdiv(R, BR), triton.cdiv(K // 64, NB))
            out.view(torch.uint8).zero_()
            fn = lambda: table_kernel[grid](q.packed.view(torch.int32), *args[1:], rcp_r, out.view(torch.int32), K, R, K,
                                            BLOCK_R=BR, NB=NB, K_FIRST=kf, num_warps=warps, enable_fp_fusion=False)
            report(f"table W {BR}x{NB * 64} w{warps} k_first={int(kf)}", fn, nbytes, out.view(torch.uint8), ref)
