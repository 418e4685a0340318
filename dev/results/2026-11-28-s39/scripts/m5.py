"""Session 39: where else does cuBLAS (torch 2.11+cu130, H200) lose a term of K in bf16 GEMMs? Every layout of a
and b, thin and square shapes, K = 64 j + d (d = 1, 2, 3, 33) from 2049 to 10275; and torch's own weight gradient of
F.linear (full fine-tuning's dW = dYᵀ X) at weight shapes of SmolLM2 / Qwen2.5-0.5B / Llama."""
import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
KS = sorted(64 * j + d for j in range(32, 161) for d in (1, 2, 3, 33))
BIG = [k for k in KS if k % 128 == 1][::3]


def rel(c, ref):
    return (c.float() - ref).abs().max().item() / ref.abs().max().item()


for (m, n) in ((4096, 16), (16, 4096), (4096, 8), (576, 16), (16, 576), (896, 64), (64, 4096), (192, 576),
               (576, 192), (1024, 4096), (4096, 4096)):
    ks = KS if m * n <= 65536 else BIG
    A = torch.randn(ks[-1], max(m, n), device="cuda").bfloat16()
    B = torch.randn(ks[-1], max(m, n), device="cuda").bfloat16()
    for a_cols in (True, False):
        for b_cols in (False, True):
            bad = []
            for K in ks:
                a = A[:K, :m].t() if a_cols else A[:K, :m].t().contiguous()
                b = B[:K, :n] if not b_cols else B[:K, :n].t().contiguous().t()
                if rel(torch.mm(a, b, out_dtype=torch.float32), a.float() @ b.float()) > 1e-4:
                    bad.append(K)
            print(f"M {m} N {n} a {'col' if a_cols else 'row'} b {'col' if b_cols else 'row'}: {len(bad)} of {len(ks)} "
                  f"K bad {bad[:12]}", flush=True)

for (out, inp) in ((64, 576), (192, 576), (576, 192), (128, 896), (896, 128), (512, 4096), (1024, 4096), (4096, 1024)):
    bad = []
    for K in BIG:
        x = torch.randn(K, inp, device="cuda").bfloat16()
        w = torch.randn(out, inp, device="cuda").bfloat16().requires_grad_()
        dy = torch.randn(K, out, device="cuda").bfloat16()
        torch.nn.functional.linear(x, w).backward(dy)
        if rel(w.grad, dy.float().t() @ x.float()) > 8e-3:
            bad.append(K)
    print(f"F.linear weight grad, weight {out} x {inp}: {len(bad)} of {len(BIG)} K bad {bad[:12]}", flush=True)
