"""NF4 dequantization: bandwidth of _nf4_dequantize_kernel per launch configuration at Llama-3.1-8B's shapes."""
import torch, triton
import kernels.nf4_dequantize as k
from kernels.references import NF4_ABSMAX_BLOCK, NF4_BLOCK
from model.qlora import NF4Weight

shapes = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
ws = {s: NF4Weight(torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in shapes}
def launch(q, out, blocks, warps):
    n = out.numel()
    grid = (triton.cdiv(triton.cdiv(n, NF4_BLOCK), blocks),)
    k._nf4_dequantize_kernel[grid](q.packed, q.absmax, q.absmax_scale, q.absmax_offset, q.absmax_code, k._levels(out.device),
                                   out, n, 1, 1, BLOCKS=blocks, BLOCK=NF4_BLOCK, ABSMAX_BLOCK=NF4_ABSMAX_BLOCK, STRIDED=False,
                                   num_warps=warps, enable_fp_fusion=False)
for blocks in (16, 32, 64, 128):
    for warps in (2, 4, 8):
        row = []
        for s, w in ws.items():
            out = torch.empty(s, device="cuda", dtype=torch.bfloat16)
            q = w.data()
            ms = triton.testing.do_bench(lambda: launch(q, out, blocks, warps), warmup=20, rep=100)
            nbytes = out.numel() * 2 + out.numel() // 2 + out.numel() // 64
            row.append(f"{s[0]}x{s[1]} {ms*1e3:7.1f} us {nbytes/ms/1e9:5.2f} TB/s")
        print(f"BLOCKS={blocks:3d} warps={warps}: " + " | ".join(row), flush=True)
# strided into [W | B] at gate's shape
out = torch.empty(14336, 4096 + 32, device="cuda", dtype=torch.bfloat16)
ms = triton.testing.do_bench(lambda: k.nf4_dequantize(ws[(14336, 4096)].data(), out[:, :4096]), warmup=20, rep=100)
print(f"strided 14336x4096 into 4128 columns: {ms*1e3:.1f} us")
# bitsandbytes for reference
w = ws[(14336, 4096)]
ms = triton.testing.do_bench(lambda: w.dequantize(kernel=False), warmup=20, rep=100)
print(f"bitsandbytes 14336x4096: {ms*1e3:.1f} us")
