"""Session 28: the one-read LoRA dY products (kernels/adapter_grads.py) against cuBLAS's three GEMMs, at the MLPs of
Qwen2.5-7B and Llama-3.1-8B (N = 4096), bf16; launch configurations swept. python ag.py"""
import statistics, sys, os
sys.path.insert(0, os.getcwd())
import torch
import kernels.adapter_grads as ag
from kernels.references import adapter_grads_reference

dev = torch.device("cuda")
s = 1.0


def timed(fn, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def case(name, I, N, r):
    F = 2 * I
    rows = torch.randn(F + 2 * r, N, device=dev).to(torch.bfloat16)
    p = torch.randn(N, 2 * r, device=dev).to(torch.bfloat16)
    b = torch.zeros(F, 2 * r, device=dev, dtype=torch.bfloat16)
    b[:I, :r] = torch.randn(I, r, device=dev); b[I:, r:] = torch.randn(I, r, device=dev)
    dy = rows[:F].t()

    def cublas():
        dyb = torch.addmm(dy.new_empty(N, 2 * r), dy, b, beta=0, alpha=s)
        torch.mm(dy[:, :I].t(), p[:, :r], out_dtype=torch.float32)
        torch.mm(dy[:, I:].t(), p[:, r:], out_dtype=torch.float32)
        rows[F:] = dyb.t()

    base = timed(cublas)
    gb = (F * N * 2) / 1e9
    print(f"{name} I={I} N={N} r={r}: cuBLAS {base:.1f} us ({gb / base * 1e3:.2f} TB/s of one dY read)", flush=True)
    q_ref = torch.empty(2 * r, N, dtype=torch.float64, device=dev)
    db_ref = adapter_grads_reference(rows[:F].double(), p.double(), b.double(), s, r, q_ref)
    orig_cfg, orig_runs = ag.launch_config, ag.runs_per_member
    results = []
    for cfg in CONFIGS:
        for mult in MULTS:
            ag.launch_config = lambda dtype, cfg=cfg: cfg
            ag.runs_per_member = lambda t, tb, m, programs, mult=mult: orig_runs(t, tb, m, programs * mult // 2)
            try:
                db = ag.adapter_grads(rows[:F], p, b, s, r, rows[F:])
                err_db = ((db.double() - db_ref).abs().max() / db_ref.abs().max()).item()
                err_q = ((rows[F:].double() - q_ref).abs().max() / q_ref.abs().max()).item()
                t = timed(lambda: ag.adapter_grads(rows[:F], p, b, s, r, rows[F:]))
                results.append((t, cfg, mult))
                print(f"  {cfg} x{mult}: {t:.1f} us ({gb / t * 1e3:.2f} TB/s)  err dB {err_db:.1e} Q {err_q:.1e}", flush=True)
            except Exception as e:
                print(f"  {cfg} x{mult}: {type(e).__name__} {str(e)[:150]}", flush=True)
    ag.launch_config, ag.runs_per_member = orig_cfg, orig_runs
    best = min(results)
    print(f"  best {best[1]} x{best[2]}: {best[0]:.1f} us against cuBLAS {base:.1f} (saves {base - best[0]:.1f} us a layer)",
          flush=True)


print(torch.cuda.get_device_name(), torch.__version__)
if os.environ.get("SWEEP"):
    CONFIGS = [(64, 256, 4, 3), (64, 256, 8, 3), (64, 256, 4, 2), (64, 128, 4, 4), (128, 128, 4, 3),
               (128, 128, 8, 3), (128, 256, 8, 2), (64, 512, 4, 2), (32, 256, 4, 4)]
    MULTS = (1, 2, 4)
    case("qwen2.5-7b", 18944, 4096, 16)
    case("llama-3.1-8b", 14336, 4096, 16)
    case("llama-3.1-8b", 14336, 4096, 64)
    case("qwen2.5-0.5b", 4864, 8192, 16)
else:  # the tree's launch configuration (x4: PROGRAMS_PER_SM = 4), and its neighbours
    CONFIGS, MULTS = [(64, 256, 4, 2), (32, 256, 4, 3), (32, 256, 4, 4)], (4, 8)
    for r in (16, 32):
        case("qwen2.5-7b", 18944, 4096, r)
        case("llama-3.1-8b", 14336, 4096, r)
    case("qwen2.5-0.5b", 4864, 8192, 16)
    case("smollm2-135m", 1536, 4096, 16)
