"""Can cuDNN's SDPA backward be called from Python with a saved (out, lse), given a broadcast zero bias? grads vs autograd, time."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
A = torch.ops.aten
for T in (4096, 16384, 65536):
    B, Hq, Hk, D = 1, 32, 8, 128
    torch.manual_seed(0)
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hk, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hk, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref = torch.autograd.grad(o, (q, k, v), g)
        def full():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(o, (q, k, v), g)
        t_full = do_bench(full, warmup=2, rep=20)
    with torch.no_grad():
        r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    out, lse, cq, ck, mq, mk, ps, po = r[:8]
    print(T, "fwd out", tuple(out.shape), "lse", tuple(lse.shape), lse.dtype, "max|o-out|", (o - out).abs().max().item())
    for name, bias in [("expand(1,1,1,1)", torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16).expand(B, Hq, T, T)),
                       ("expand(1,1,1,T)", torch.zeros(1, 1, 1, T, device="cuda", dtype=torch.bfloat16).expand(B, Hq, T, T))]:
        try:
            def bwd():
                return A._scaled_dot_product_cudnn_attention_backward(g, q, k, v, out, lse, ps, po, bias, cq, ck, mq, mk, 0.0, True)
            dq, dk, dv = bwd()
            errs = [(a - b).abs().max().item() for a, b in zip((dq, dk, dv), ref)]
            t = do_bench(bwd, warmup=2, rep=20)
            print(f"  {name}: shapes {tuple(dq.shape)} {tuple(dk.shape)} max err {errs}; bwd {t:.2f} ms vs autograd fwd+bwd {t_full:.2f} ms")
        except Exception as e:
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}")
    del q, k, v, g, o, ref, out, lse
    torch.cuda.empty_cache()
