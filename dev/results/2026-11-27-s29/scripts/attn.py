"""Session 29: causal GQA attention fwd+bwd at the 7-9B shapes, per SDPA backend (GPU kernel time, profiler)."""
import json, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
print("cudnn", torch.backends.cudnn.version(), torch.__version__, torch.cuda.get_device_name(), flush=True)
B = BK = SDPBackend
def run(shape, name, backend, expand, n=10):
    Bn, T, Hq, Hk, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda H: torch.randn(Bn, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    q, k, v = mk(Hq), mk(Hk), mk(Hk)
    do = torch.randn(Bn, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    def it():
        kk, vv = (k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)) if expand else (k, v)
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
        o.backward(do)
        q.grad = k.grad = v.grad = None
    try:
        for _ in range(3): it()
    except Exception as e:
        print(json.dumps({"shape": shape, "name": name, "error": str(e)[:200]}), flush=True); return
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n): it()
        torch.cuda.synchronize()
    ks = {}
    for e in p.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            ks[e.key[:70]] = round(e.self_device_time_total / n, 1)
    tot = sum(ks.values())
    fl = 4 * Bn * T * T * Hq * D / 2 * 3.5
    print(json.dumps({"shape": shape, "name": name, "us": round(tot, 1), "tflops": round(fl / tot / 1e6, 1),
                      "kernels": dict(sorted(ks.items(), key=lambda x: -x[1])[:5])}), flush=True)
for shape in [(2, 2048, 28, 4, 128), (2, 2048, 32, 8, 128)]:
    for name, bk, ex in [("cudnn-gqa", B.CUDNN_ATTENTION, False), ("flash-gqa", B.FLASH_ATTENTION, False),
                         ("eff-gqa", B.EFFICIENT_ATTENTION, False), ("cudnn-exp", B.CUDNN_ATTENTION, True),
                         ("flash-exp", B.FLASH_ATTENTION, True)]:
        run(shape, name, bk, ex)
