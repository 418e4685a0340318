"""Session 39: the single LoRALinear's dB and dA at 4097 tokens are 3-7% off float64 on an H200 (m2.py), at 4095,
4096 and 4113 not. Both come from model/lora.py `_mm_to`: torch.mm(a, b, out_dtype=torch.float32) of bf16 operands,
with K = tokens. Which K and which layouts does that GEMM get wrong?"""
import torch

torch.manual_seed(0)
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())


def err(c, ref):
    return (c.double() - ref).abs().max().item() / ref.abs().max().item()


bad = []
for K in (1023, 1025, 2047, 2049, 4095, 4096, 4097, 4098, 4099, 4100, 4104, 4112, 4113, 4160, 4224, 6145, 8191, 8193,
          8194, 12289, 16385, 16400):
    for M, N in ((4096, 16), (16, 4096), (4096, 32), (14336, 16), (16, 14336), (4096, 4096)):
        for ta in (False, True):
            for tb in (False, True):
                a = (torch.randn(K, M, device="cuda").t() if ta else torch.randn(M, K, device="cuda")).bfloat16()
                b = (torch.randn(N, K, device="cuda").t() if tb else torch.randn(K, N, device="cuda")).bfloat16()
                ref = a.double() @ b.double()
                e_out = err(torch.mm(a, b, out_dtype=torch.float32), ref)
                e_bf = err(torch.mm(a, b), ref)
                e_f32 = err(a.float() @ b.float(), ref)
                flag = "BAD" if e_out > 5 * max(e_f32, 1e-3) else ""
                if flag or K in (4096, 4097):
                    print(f"K {K} M {M} N {N} a{'T' if ta else ''} b{'T' if tb else ''}: out_dtype fp32 {e_out:.2e}, "
                          f"bf16 {e_bf:.2e}, fp32 {e_f32:.2e} {flag}", flush=True)
                if flag:
                    bad.append((K, M, N, ta, tb))
print("bad:", len(bad))
