"""Session 39: cuBLAS (torch 2.11+cu130, H200) gets bf16 torch.mm(aT, b) wrong at K = 4097, 6145, 8193, ... (m3.py):
(A) is it the last element of K that is lost? (B) every bad K in 2048..20480 for two thin shapes; (C) what gets the
same product right at those K."""
import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.backends.cuda.preferred_blas_library())


def rel(c, ref):
    return (c.float() - ref).abs().max().item() / ref.abs().max().item()


K, M, N = 4097, 4096, 16
a = torch.randn(K, M, device="cuda").bfloat16().t()
b = torch.randn(K, N, device="cuda").bfloat16()
c = torch.mm(a, b, out_dtype=torch.float32)
full, no_last, no_first = a.float() @ b.float(), a[:, :-1].float() @ b[:-1].float(), a[:, 1:].float() @ b[1:].float()
print(f"(A) K {K}: vs full {rel(c, full):.2e}, vs without the last k {rel(c, no_last):.2e}, without the first "
      f"{rel(c, no_first):.2e}")
for lo, hi in ((0, 2048), (2048, 4096), (4096, 4097)):
    part = a[:, lo:hi].float() @ b[lo:hi].float()
    print(f"    without k in [{lo}, {hi}): {rel(c, full - part):.2e}")

for M, N in ((4096, 16), (16, 4096), (896, 16), (16, 896)):
    bad = []
    A = torch.randn(20480, M, device="cuda").bfloat16()
    B = torch.randn(20480, N, device="cuda").bfloat16()
    for K in range(2048, 20481):
        a, b = A[:K].t(), B[:K]
        if rel(torch.mm(a, b), a.float() @ b.float()) > 8e-3:
            bad.append(K)
    print(f"(B) M {M} N {N} aT b: {len(bad)} bad K in 2048..20480: {bad[:40]}", flush=True)
    ok = []
    for K in (4097, 6145, 8193, 16385):
        a, b = A[:K].t(), B[:K]
        ref = a.float() @ b.float()
        cands = {"a contiguous": lambda: torch.mm(a.contiguous(), b),
                 "b column-major": lambda: torch.mm(a, b.t().contiguous().t()),
                 "(bT a)T": lambda: torch.mm(b.t(), a.t()).t(),
                 "bmm": lambda: torch.bmm(a[None], b[None])[0],
                 "matmul fp32 out": lambda: torch.mm(a, b, out_dtype=torch.float32)}
        line = []
        for name, fn in cands.items():
            line.append(f"{name} {rel(fn(), ref):.1e}")
        default = torch.backends.cuda.preferred_blas_library()
        other = "cublaslt" if "Lt" not in str(default) else "cublas"
        torch.backends.cuda.preferred_blas_library(other)
        line.append(f"{other} {rel(torch.mm(a, b), ref):.1e} / out fp32 "
                    f"{rel(torch.mm(a, b, out_dtype=torch.float32), ref):.1e}")
        torch.backends.cuda.preferred_blas_library(default)
        print(f"(C) M {M} N {N} K {K}: " + ", ".join(line), flush=True)
