"""cuDNN's SDPA backward called from a saved (out, lse) with no bias (None under _AutoDispatchBelowAutograd):
grads against autograd's, and its time against autograd's forward + backward, at 2 x 2048 and 1 x 65536
(Llama-3.1-8B's heads: 32 q, 8 kv, head_dim 128, causal, bf16, the (B, T, H, D) layout transposed)."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
A = torch.ops.aten
for B, T in ((2, 2048), (1, 16384), (1, 65536)):
    Hq, Hk, D = 32, 8, 128
    torch.manual_seed(0)
    mk = lambda h: torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = mk(Hq), mk(Hk), mk(Hk)
    g = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref = torch.autograd.grad(o, (q, k, v), g)
        def full():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(o, (q, k, v), g)
        t_full = do_bench(full, warmup=2, rep=20)
    def fwd():
        with torch.no_grad():
            return A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    r = fwd()
    t_fwd = do_bench(fwd, warmup=2, rep=20)
    out, lse, cq, ck, mq, mk_, ps, po = r[:8]
    print(B, T, "out", tuple(out.shape), out.stride(), "lse", tuple(lse.shape), lse.dtype, "cq", cq, "ps", ps.shape,
          ps.dtype, "max|o-out|", (o - out).abs().max().item(), flush=True)
    def bwd():
        with torch._C._AutoDispatchBelowAutograd():
            return A._scaled_dot_product_cudnn_attention_backward(g, q, k, v, out, lse, ps, po, None, cq, ck, mq, mk_,
                                                                  0.0, True)
    try:
        dq, dk, dv = bwd()
        errs = [(a - b).abs().max().item() for a, b in zip((dq, dk, dv), ref)]
        same = [torch.equal(a, b) for a, b in zip((dq, dk, dv), ref)]
        t = do_bench(bwd, warmup=2, rep=20)
        print(f"  no bias: shapes {tuple(dq.shape)} {tuple(dk.shape)} strides {dq.stride()} max err {errs} equal {same}; "
              f"bwd {t:.3f} ms, fwd {t_fwd:.3f} ms, autograd fwd+bwd {t_full:.3f} ms", flush=True)
    except Exception as e:
        print(f"  no bias: {type(e).__name__}: {str(e)[:400]}", flush=True)
    del q, k, v, g, o, ref, out, lse
    torch.cuda.empty_cache()
