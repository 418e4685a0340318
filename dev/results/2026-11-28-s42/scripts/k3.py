"""Session 42: the SwiGLU kernels with the adapters' terms, as the LoRA MLP calls them, of one tree:
python k3.py ROOT -> a line per shape (fwd, bwd in us; graph replays of 20)."""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, os.path.abspath(root))
import torch
from kernels.swiglu import swiglu_backward, swiglu_forward
dev, r = "cuda", 16
for name, I, N in (("llama-3.1-8b 2x2048", 14336, 4096), ("qwen2.5-7b 2x2048", 18944, 4096),
                   ("tinyllama 4x2048", 5632, 8192), ("qwen2.5-0.5b 4x2048", 4864, 8192)):
    torch.manual_seed(0)
    gu = torch.randn(2 * I, N, device=dev, dtype=torch.bfloat16)
    dh = torch.randn(I, N, device=dev, dtype=torch.bfloat16) * 0.01
    b = torch.randn(2 * I, 2 * r, device=dev, dtype=torch.bfloat16) * 0.01
    xa = torch.randn(N, 2 * r, device=dev, dtype=torch.bfloat16)
    a_d = torch.randn(r, I, device=dev, dtype=torch.bfloat16) * 0.01
    dyb = torch.randn(N, r, device=dev, dtype=torch.bfloat16)
    terms = ((b[:I, :r], xa[:, :r]), (b[I:, r:], xa[:, r:]))
    amax = torch.empty((), device=dev, dtype=torch.bfloat16)
    h = swiglu_forward(gu[:I], gu[I:], amax=amax, terms=terms)
    gu2, dh2 = gu.clone(), dh.clone()
    dg, du, hb = swiglu_backward(dh2, gu2[:I], gu2[I:], inplace=True, write_h=True, amax=amax, terms=terms,
                                 dh_term=(a_d.t(), dyb))
    same_h = torch.equal(h, hb)
    digest = float(dg.float().sum() + du.float().sum() + h.float().sum())
    out = {}
    for kind, fn in (("fwd", lambda: swiglu_forward(gu[:I], gu[I:], amax=amax, terms=terms)),
                     ("bwd", lambda: swiglu_backward(dh, gu[:I], gu[I:], inplace=True, write_h=True, amax=amax,
                                                     terms=terms, dh_term=(a_d.t(), dyb)))):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20): fn()
        ts = []
        for _ in range(5):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); g.replay(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 20 * 1e3)
        out[kind] = round(sorted(ts)[2], 1)
        del g
    print(json.dumps({"tree": root, "shape": name, **out, "h_equal_fwd_bwd": same_h, "digest": digest}), flush=True)
