"""The decoding GEMMs with a norm prologue (decode_swiglu, decode_qkv) of the tree at ROOT: µs a launch in a CUDA
graph of L launches over L distinct weights (cold L2), and a hash of their outputs (the values must not change)."""
import hashlib
import os
import sys

root = os.path.abspath(sys.argv[1])
sys.path.insert(0, root)
import torch

from kernels.decode_linear import Workspace
from kernels.decode_qkv import decode_qkv
from kernels.decode_swiglu import decode_swiglu


def timed(fns, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [f() for f in fns]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    h = hashlib.sha1()
    for o in outs:
        h.update(o.float().cpu().numpy().tobytes())
    return min(best), h.hexdigest()[:12]


SHAPES = {"qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24), "smollm2-135m": (576, 1536, 9, 3, 64, 30)}
for rows in (16, 64):
    for name, (H, I, HQ, HK, D, L) in SHAPES.items():
        torch.manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        xs = [torch.randn(rows, H, device=dev, dtype=bf) for _ in range(L)]
        nw = (1 + 0.1 * torch.randn(H, device=dev)).to(bf)
        gu = [torch.randn(2 * I, H, device=dev, dtype=bf) / H ** 0.5 for _ in range(L)]
        qkv = [torch.randn((HQ + 2 * HK) * D, H, device=dev, dtype=bf) / H ** 0.5 for _ in range(L)]
        bias = [torch.randn((HQ + 2 * HK) * D, device=dev, dtype=bf) for _ in range(L)]
        cos, sin = torch.rand(rows, D, device=dev, dtype=bf), torch.rand(rows, D, device=dev, dtype=bf)
        kc = [torch.zeros(rows, HK, 96, D, device=dev, dtype=bf) for _ in range(L)]
        vc = [torch.zeros(rows, HK, 96, D, device=dev, dtype=bf) for _ in range(L)]
        at = torch.tensor([40], device=dev)
        ws = Workspace()
        t1, h1 = timed([lambda x=x, w=w: decode_swiglu(x, nw, w, None, ws) for x, w in zip(xs, gu)])
        t2, h2 = timed([lambda x=x, w=w, b=b, k=k, v=v: decode_qkv(x, nw, w, b, cos, sin, k, v, at, HQ, ws)
                        for x, w, b, k, v in zip(xs, qkv, bias, kc, vc)])
        kh = hashlib.sha1(b"".join(k.float().cpu().numpy().tobytes() for k in kc[:3])).hexdigest()[:12]
        print(f"{os.path.basename(root) or root} {name} rows {rows}: gate|up {t1:6.2f} us ({2 * I * H * 2 / 1e6 / t1:.2f} "
              f"TB/s) hash {h1}; q|k|v {t2:6.2f} us ({(HQ + 2 * HK) * D * H * 2 / 1e6 / t2:.2f} TB/s) hash {h2} "
              f"cache {kh}", flush=True)
